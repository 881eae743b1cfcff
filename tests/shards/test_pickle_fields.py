"""Pickle fields read from a store are unpickled only when the user opts in
(`allow_pickle=True`): by default a `pyd`/`pickle` field raises `ValueError` naming the
field, the sample, its shard and the opt-in, in the reading process and in a worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")

from stoker import DataLoader
from stoker.shards import ShardedDataset, ShardedSampler, decode_auto, write_shards

N = 6


class Marker:
    """A class a pickle names: unpickling it would run code of the writer's choosing."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Marker) and other.i == self.i


def samples() -> list[dict[str, Any]]:
    return [{"__key__": f"{i:03d}", "cls": i, "pyd": {"i": i, "m": Marker(i)}} for i in range(N)]


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def test_decode_auto_refuses_a_pickle_field_unless_allowed() -> None:
    raw = {"__key__": "k", "cls": b"3", "obj.pickle": b"\x80\x05K\x07."}  # pickle of 7
    with pytest.raises(ValueError, match=r"sample 'k', field 'obj.pickle': is a pickle.*allow_pickle=True"):
        decode_auto(raw)
    assert decode_auto(raw, allow_pickle=True) == {"__key__": "k", "cls": 3, "obj.pickle": 7}
    assert decode_auto({"__key__": "k", "cls": b"3"}) == {"__key__": "k", "cls": 3}  # nothing to refuse
    with pytest.raises(TypeError, match="allow_pickle should be True or False, but got allow_pickle='yes'"):
        decode_auto(raw, allow_pickle="yes")  # type: ignore[arg-type]


def test_a_dataset_refuses_pickle_fields_by_default_naming_the_sample_and_shard(s3_url: str, tmp_path: Path) -> None:
    write_shards(samples(), s3_url, workers=1)
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as info:
        data[2]
    text = str(info.value)
    assert "field 'pyd': is a pickle" in text and "allow_pickle=True" in text
    assert "sample 2" in text and f"shard {s3_url}/" in text
    assert ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), decode=None)[2]["pyd"][:1] == b"\x80"
    with pytest.raises(TypeError, match="allow_pickle should be True or False, but got allow_pickle=1"):
        ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), allow_pickle=1)  # type: ignore[arg-type]


def test_a_dataset_with_allow_pickle_decodes_them(s3_url: str, tmp_path: Path) -> None:
    write_shards(samples(), s3_url, workers=1)
    data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), allow_pickle=True)
    assert [data[i]["pyd"] for i in range(N)] == [{"i": i, "m": Marker(i)} for i in range(N)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_refuses_them_too_and_decodes_them_when_allowed(s3_url: str, tmp_path: Path, method: str) -> None:
    write_shards(samples(), s3_url, workers=1)
    for allow in (False, True):
        data = ShardedDataset(s3_url, cache_dir=str(tmp_path / "cache"), allow_pickle=allow)
        loader = DataLoader(
            data,
            batch_size=2,
            sampler=ShardedSampler(data, shuffle=False),
            num_workers=1,
            multiprocessing_context=method,
            collate_fn=as_list,
        )
        if allow:
            got = [s["pyd"] for batch in loader for s in batch]
            assert got == [{"i": i, "m": Marker(i)} for i in range(N)]
        else:
            with pytest.raises(ValueError, match=r"field 'pyd': is a pickle.*allow_pickle=True"):
                list(loader)
        data.close()
