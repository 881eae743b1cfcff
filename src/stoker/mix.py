"""Many sources, one stream: weighted mixing and sequence packing that resume exactly.

`MixedDataset` mixes datasets in set proportions (of documents or of tokens, following a
schedule if asked) with no sampling drift; `PackedDataset` packs a stream of token documents
into rows of `seq_len` tokens (best-fit or greedy, over windows that each make K rows, the
pieces that do not fit carried to the next) with the fields variable-length attention takes,
or those of JAX models (`fields="jax"` or `"maxtext"`: fixed shapes, `segment_ids` and
`positions`); `StreamSampler` walks either stream epoch after epoch, split over ranks, so
that a loader's `state_dict()` resumes exactly on another world size; Lightning, accelerate
and the Hugging Face Trainer keep it as each rank's share.

    from stoker.mix import MixedDataset, PackedDataset, StreamSampler, TokenDataset, collate_packed

    mix = MixedDataset([web, code, books], [0.6, 0.3, 0.1], weigh="tokens")
    rows = PackedDataset(mix, seq_len=2048, window_size=1024)
    loader = DataLoader(rows, batch_size=8, sampler=StreamSampler(rows),
                        collate_fn=collate_packed, num_workers=4)
"""

from ._mix.errors import DocumentError
from ._mix.mix_dataset import MixedDataset
from ._mix.pack_dataset import PackedDataset, collate_packed
from ._mix.stream_sampler import StreamSampler
from ._mix.tokens import TokenDataset

__all__ = [
    "DocumentError",
    "MixedDataset",
    "PackedDataset",
    "StreamSampler",
    "TokenDataset",
    "collate_packed",
]
