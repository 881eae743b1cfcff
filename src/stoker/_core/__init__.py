"""The loading core: the DataLoader and its iterator, the scheduler, engines, worker loop, protocol and transports."""
