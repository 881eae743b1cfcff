"""One interface over the generators a user may pass: numpy, an int seed, or torch.

Every random draw in stoker (samplers, `random_split`, the workers' base seed) goes through
`RandomSource`, so that

- a `torch.Generator` is consumed with torch's own operations, in torch's order, giving
  exactly `torch.utils.data`'s sequence for the same seed;
- a `numpy.random.Generator` is consumed directly;
- an int seed becomes one `numpy.random.default_rng(seed)`, consumed across epochs;
- no generator means the flavour's global RNG: numpy's (`np.random.seed` reproduces a run)
  or torch's (`torch.manual_seed` does).
"""

from __future__ import annotations

import base64
import sys
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from .._base.checks import check_choice, fail

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

GeneratorLike = Union[None, int, np.random.Generator, "torch.Generator"]
FLAVOURS = ("numpy", "torch")
_SEED_BOUND = 2**63


def is_torch_generator(obj: Any) -> TypeIs[torch.Generator]:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Generator)


def check_generator(generator: Any, argname: str = "generator") -> None:
    """Raise TypeError unless `generator` is None, an int seed, a numpy or a torch Generator."""
    if generator is None or is_torch_generator(generator):
        return
    if isinstance(generator, np.random.Generator):
        return
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
        if generator < 0:
            fail(
                ValueError, argname, "None, an int seed >= 0, a numpy.random.Generator or a torch.Generator", generator
            )
        return
    raise TypeError(
        f"{argname} should be None, an int seed, a numpy.random.Generator or a torch.Generator, "
        f"but got {type(generator).__name__}"
    )


class _NumpyDraws:
    def __init__(self, rng: Any) -> None:
        self.rng = rng  # numpy Generator, or the legacy global RandomState

    def permutation(self, n: int) -> list[int]:
        return self.rng.permutation(n).tolist()

    def integers(self, high: int, size: int) -> list[int]:
        if isinstance(self.rng, np.random.Generator):
            return self.rng.integers(0, high, size=size).tolist()
        return self.rng.randint(0, high, size=size).tolist()

    def multinomial(self, weights: np.ndarray, num_samples: int, replacement: bool) -> list[int]:
        p = np.asarray(weights, dtype=np.float64)
        return self.rng.choice(len(p), size=num_samples, replace=replacement, p=p / p.sum()).tolist()


class _TorchDraws:
    def __init__(self, generator: Any) -> None:
        self.generator = generator  # a torch.Generator, or None for torch's global one

    def permutation(self, n: int) -> list[int]:
        import torch

        return torch.randperm(n, generator=self.generator).tolist()

    def integers(self, high: int, size: int) -> list[int]:
        import torch

        # torch's RandomSampler draws with replacement in chunks of 32; so do we, to stay in step
        out: list[int] = []
        for _ in range(size // 32):
            out += torch.randint(high=high, size=(32,), dtype=torch.int64, generator=self.generator).tolist()
        out += torch.randint(high=high, size=(size % 32,), dtype=torch.int64, generator=self.generator).tolist()
        return out

    def multinomial(self, weights: Any, num_samples: int, replacement: bool) -> list[int]:
        import torch

        w = torch.as_tensor(weights, dtype=torch.double)
        return torch.multinomial(w, num_samples, replacement, generator=self.generator).tolist()


Draws = Union[_NumpyDraws, _TorchDraws]


class RandomSource:
    """Where one random object (a sampler, a split, a loader) gets its randomness."""

    def __init__(self, generator: GeneratorLike, flavour: str = "numpy") -> None:
        check_generator(generator)
        check_choice("flavour", flavour, FLAVOURS)
        self.generator = generator
        self.flavour = flavour
        # the numpy generator drawn from: the user's own, or one made once from an int seed
        self._numpy: np.random.Generator | None = None
        if isinstance(generator, np.random.Generator):
            self._numpy = generator
        elif isinstance(generator, (int, np.integer)):
            self._numpy = np.random.default_rng(int(generator))
        # A loader's seed source: the base seed of the run's first iterator (or the one a loaded
        # state names). Per-sample randomness derives from it in every epoch, so it does not
        # depend on how many base seeds were drawn: one per persistent iterator, one per epoch
        # otherwise (see _core/seeding). None until that iterator draws; the loader sets it.
        self.run_seed: int | None = None

    def draws(self) -> Draws:
        """Draws from the source itself (no generator: straight from the global RNG)."""
        if self.generator is None:
            if self.flavour == "torch":
                return _TorchDraws(None)
            return _NumpyDraws(np.random.mtrand._rand)
        return self._direct()

    def fresh_draws(self) -> Draws:
        """Draws for one pass; with no generator, a new one seeded from the global RNG.

        This is how torch's RandomSampler treats `generator=None`.
        """
        if self.generator is None:
            if self.flavour == "torch":
                import torch

                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                return _TorchDraws(torch.Generator().manual_seed(seed))
            return _NumpyDraws(np.random.default_rng(int(np.random.randint(0, 2**63 - 1, dtype=np.int64))))
        return self._direct()

    def _direct(self) -> Draws:
        if is_torch_generator(self.generator):
            return _TorchDraws(self.generator)
        return _NumpyDraws(self._numpy)

    # ------------------------------------------------------------ resume
    def key(self) -> tuple[Any, ...]:
        """What this source draws from: sources with equal keys share one stream."""
        if self.generator is None:
            return (self.flavour + "-global",)
        if is_torch_generator(self.generator):
            return ("torch", id(self.generator))
        return ("numpy", id(self._numpy))

    def capture(self) -> dict[str, Any]:
        """The state of the stream this source draws from, as plain JSON values."""
        kind = self.key()[0]
        if kind == "torch-global":
            import torch

            return {"kind": kind, "state": _b64(torch.get_rng_state().numpy().tobytes())}
        if kind == "torch":
            return {"kind": kind, "state": _b64(self.generator.get_state().numpy().tobytes())}  # type: ignore[union-attr]
        if kind == "numpy-global":
            name, key, pos, has_gauss, cached = np.random.get_state()
            return {
                "kind": kind,
                "state": [name, _b64(np.asarray(key, np.uint32).tobytes()), int(pos), int(has_gauss), float(cached)],
            }
        assert self._numpy is not None
        return {"kind": kind, "state": _plain(self._numpy.bit_generator.state)}

    def restore(self, captured: dict[str, Any]) -> None:
        """Put the stream back into a state `capture` returned."""
        kind, state = captured["kind"], captured["state"]
        if kind != self.key()[0]:
            raise ValueError(f"a {kind} generator state cannot be restored into a {self.key()[0]} generator")
        if kind in ("torch-global", "torch"):
            import torch

            tensor = torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8)
            if kind == "torch":
                self.generator.set_state(tensor)  # type: ignore[union-attr]
            else:
                torch.set_rng_state(tensor)
        elif kind == "numpy-global":
            name, key, pos, has_gauss, cached = state
            np.random.set_state((name, np.frombuffer(base64.b64decode(key), np.uint32), pos, has_gauss, cached))
        else:
            assert self._numpy is not None
            self._numpy.bit_generator.state = _unplain(state)

    def seed64(self) -> int:
        """One non-negative 63-bit seed, drawn as torch's DataLoader draws its base seed."""
        generator = self.generator
        if is_torch_generator(generator) or (generator is None and self.flavour == "torch"):
            import torch

            return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        if self._numpy is None:
            return int(np.random.randint(0, _SEED_BOUND - 1, dtype=np.int64))
        return int(self._numpy.integers(0, _SEED_BOUND - 1))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _plain(value: Any) -> Any:
    """A numpy bit generator's state as JSON values (arrays as base64 with their dtype)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"__array__": _b64(value.tobytes()), "dtype": value.dtype.str}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if "__array__" in value:
            return np.frombuffer(base64.b64decode(value["__array__"]), np.dtype(value["dtype"])).copy()
        return {k: _unplain(v) for k, v in value.items()}
    return value
