"""`warpforge tune NAME [options]`: the tile sweeps that fill the families' per-arch config tables (configs.py),
each timing candidate configs on this GPU at its family's benchmark shapes and writing what it measured
(`--out FILE.json`). Winners go into the family's configs.py by hand, with the numbers in benchmarks/NOTES.md.
Each module's main(argv) is one sweep; they need a CUDA GPU."""
SWEEPS = {"attention": "attention", "mla": "mla", "moe": "moe", "moe-wgrad": "moe_wgrad", "moe-sorted": "moe_sorted",
          "moe-decode": "moe_decode", "paged": "paged", "monarch": "monarch", "lce": "lce", "sparse": "sparse",
          "evoformer": "evoformer", "norm": "norm"}
