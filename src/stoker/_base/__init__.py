"""The ground floor: what every other package of stoker may use, importing nothing of stoker
itself (the hooks stoker calls on users' datasets and samplers, the per-process holder that
keeps fork safety in one place, the argument checks in torch's wording)."""
