"""`_base/checks.py`: a wrong type is a TypeError, a wrong value a ValueError, each worded as
torch words its own ("<name> should be ..., but got <name>=<value>")."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from stoker._base.checks import check_bool, check_callable, check_choice, check_int, check_number


def test_check_int_accepts_integers_in_bounds_and_names_the_rest() -> None:
    assert check_int("n", 3, low=1) == 3 and type(check_int("n", np.int64(3), low=1)) is int
    assert check_int("n", None, none_ok=True) is None
    with pytest.raises(TypeError, match=re.escape("n should be an int >= 1, but got n='3'")):
        check_int("n", "3", low=1)
    with pytest.raises(TypeError, match=re.escape("n should be an int, but got n=True")):
        check_int("n", True)
    with pytest.raises(TypeError, match=re.escape("n should be an int, but got n=2.0")):
        check_int("n", 2.0)
    with pytest.raises(ValueError, match=re.escape("n should be an int >= 0 and <= 9 (bytes) or None, but got n=10")):
        check_int("n", 10, low=0, high=9, unit="bytes", none_ok=True)


def test_check_number_refuses_nan_infinity_and_out_of_bounds() -> None:
    assert check_number("t", 2, above=0) == 2.0 and check_number("t", np.float32(0.5), low=0) == 0.5
    assert check_number("t", math.inf, low=0, finite=False) == math.inf
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(
            ValueError, match=re.escape(f"t should be a finite number >= 0 (seconds), but got t={bad!r}")
        ):
            check_number("t", bad, low=0, unit="seconds")
    with pytest.raises(ValueError, match=re.escape("t should be a finite number > 0, but got t=0")):
        check_number("t", 0, above=0)
    for bad_type in ("1", b"1", False, [1]):
        with pytest.raises(TypeError, match=re.escape(f"t should be a finite number >= 0, but got t={bad_type!r}")):
            check_number("t", bad_type, low=0)


def test_check_bool_callable_and_choice() -> None:
    assert check_bool("flag", False) is False
    with pytest.raises(TypeError, match=re.escape("flag should be True or False, but got flag=1")):
        check_bool("flag", 1)
    assert check_callable("fn", len) is len and check_callable("fn", None, none_ok=True) is None
    with pytest.raises(TypeError, match=re.escape("fn should be a callable taking a file or None, but got fn=3")):
        check_callable("fn", 3, none_ok=True, takes="a file")
    assert check_choice("client", "auto", ("auto", "fsspec")) == "auto"
    with pytest.raises(ValueError, match=re.escape("client should be 'auto' or 'fsspec', but got client='s3'")):
        check_choice("client", "s3", ("auto", "fsspec"))
    with pytest.raises(ValueError, match=re.escape("kind should be 'a', 'b' or 'c', but got kind=[]")):
        check_choice("kind", [], {"a": 1, "b": 2, "c": 3})
    with pytest.raises(ValueError, match=re.escape("decode should be 'auto', None or a callable, but got decode=3")):
        check_choice("decode", 3, ("auto", None), also="a callable")
