"""stoker.ray's errors: `ReadError` (the dataset or the collate_fn raised in a read task) and
`ShippingError` (the dataset cannot be sent to the cluster or rebuilt there), the failure a
read task raises to carry its message through Ray's wrappers, and finding it again."""

from __future__ import annotations

from typing import Any


class ReadError(RuntimeError):
    """The dataset (or the collate_fn) raised inside a Ray read task.

    The message names the sample index (or the batch's indices, for `__getitems__`), the
    original exception's type and message, and the remote traceback. stoker.ray raises it
    in the driver, where the batches (or rows) are read.

    Args:
        message: The message described above.
        exc_type: The name of the original exception's type, kept as the attribute
            `exc_type`. Defaults to "".
    """

    def __init__(self, message: str, exc_type: str = "") -> None:
        super().__init__(message)
        self.exc_type = exc_type


class ShippingError(RuntimeError):
    """The dataset could not be sent to the Ray cluster (not picklable), or could not be
    rebuilt there (its class or module is not importable on the workers).

    The message says which, names the dataset's class and module, and how to ship the
    code to the workers (`ray.init(runtime_env=...)`).
    """


class _TaskFailure(Exception):
    """Raised in a read task; carries a finished message across Ray's wrappers."""

    def __init__(self, kind: str, message: str, exc_type: str = "") -> None:
        super().__init__(kind, message, exc_type)
        self.kind = kind
        self.message = message
        self.exc_type = exc_type

    def __str__(self) -> str:
        return self.message


def _describe_type(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__qualname__} from module {kind.__module__!r}"


_RUNTIME_ENV_HINT = (
    "Every Ray worker must be able to import the dataset's class: install its package on every "
    "node, or ship the code with ray.init(runtime_env={'py_modules': [your_module]}) or "
    "ray.init(runtime_env={'working_dir': '.'}); a class defined in a script's __main__ or in a "
    "test module cannot be imported by the workers unless it is shipped so"
)


def _failure(where: str, exc: BaseException) -> _TaskFailure:
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _TaskFailure(
        "read",
        f"{where} raised {type(exc).__name__}: {exc} (in a Ray read task of stoker.ray)\n\n"
        f"The read task's traceback:\n{text}",
        type(exc).__name__,
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _innermost(exc: BaseException) -> BaseException:
    """The original exception under Ray's wrappers (`cause`, `__cause__`)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def _task_failure(exc: BaseException) -> _TaskFailure | None:
    seen = set()
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _TaskFailure):
            return current
        stack.extend([getattr(current, "cause", None), current.__cause__, current.__context__])
    return None


def _explained(exc: BaseException) -> BaseException | None:
    """stoker's own error for a failure inside a read task, or None when it is not one."""
    failure = _task_failure(exc)
    if failure is None:
        return None
    if failure.kind == "ship":
        return ShippingError(failure.message)
    return ReadError(failure.message, failure.exc_type)
