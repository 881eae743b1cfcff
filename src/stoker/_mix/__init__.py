"""The code behind `stoker.mix` (the public names are re-exported there): many sources, one
stream, addressed by position so that it resumes exactly on any world size. `mix_order` and
`pack_rows` are the pure cores (the mixed order and the packing of documents into rows,
functions of their inputs alone); `mix_dataset`, `pack_dataset` and `tokens` are the datasets
built on them; `errors` holds the package's exception types."""
