"""stoker inside training frameworks that rebuild a user's DataLoader."""
