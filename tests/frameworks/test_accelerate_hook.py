"""How stoker.torch hooks into accelerate, in one process: whichever is imported first, a
prepared stoker loader runs stoker inside accelerate's wrapper with its stoker options; a
torch loader stays torch's unless the accelerator was adopted; adopt() refuses what it cannot
take; importing stoker.torch never imports accelerate."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(300)  # a subprocess that imports torch and accelerate, under load

PREPARE = """
import torch
{imports}
class Numbers(torch.utils.data.Dataset):
    def __len__(self): return 12
    def __getitem__(self, i): return i
accelerator = Accelerator(cpu=True)
mine = accelerator.prepare(stoker.torch.DataLoader(Numbers(), batch_size=4, num_workers=1, max_worker_restarts=3, stats=False))
theirs = accelerator.prepare(torch.utils.data.DataLoader(Numbers(), batch_size=4))
assert type(mine.base_dataloader) is stoker.torch.DataLoader, type(mine.base_dataloader)
assert mine.base_dataloader.max_worker_restarts == 3 and mine.base_dataloader.stats_enabled is False
assert type(theirs.base_dataloader) is torch.utils.data.DataLoader
assert [int(i) for b in mine for i in b] == list(range(12))
assert isinstance(mine.state_dict(), dict) and "position" in mine.state_dict()
skipped = accelerator.skip_first_batches(mine, 1)
assert type(skipped.base_dataloader) is stoker.torch.DataLoader and [int(i) for b in skipped for i in b] == list(range(4, 12))
stoker.torch.adopt(accelerator, thread_pool=True)
adopted = accelerator.prepare(torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=2))
assert type(adopted.base_dataloader) is stoker.torch.DataLoader and adopted.base_dataloader.thread_pool
print("ok")
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("order", ["stoker first", "accelerate first"])
def test_prepare_keeps_stoker_whichever_is_imported_first(order: str) -> None:
    imports = ["import stoker.torch", "from accelerate import Accelerator"]
    if order == "accelerate first":
        imports.reverse()
    done = run(PREPARE.format(imports="\n".join(imports)))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_importing_stoker_torch_does_not_import_accelerate() -> None:
    done = run("import sys, stoker.torch\nassert 'accelerate' not in sys.modules\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_adopt_refuses_other_objects_and_unknown_options() -> None:
    import accelerate  # noqa: F401

    import stoker.torch

    with pytest.raises(TypeError, match=r"accelerate\.Accelerator or a transformers\.Trainer"):
        stoker.torch.adopt(object())
    with pytest.raises(TypeError, match="unknown stoker option"):
        stoker.torch.adopt(object(), num_workers=3)


def test_an_accelerate_without_the_expected_functions_is_left_alone_with_a_warning() -> None:
    from types import ModuleType

    from stoker._frameworks import accelerate as hook

    fake = ModuleType("accelerate.accelerator")
    with pytest.warns(RuntimeWarning, match="rebuilt as torch DataLoaders"):
        hook._patch(fake)
