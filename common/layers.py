"""The harness in layers: which module of common/ belongs to which layer.

Imports go one way, from a later layer to an earlier one, never back (not even
inside a function); a module may import one of its own layer as long as that
makes no circle. tests/test_layers.py checks every import of every common/*.py
against this table.

0. facts: what the lab is about, with no behaviour of its own -- where files
   live (paths), the stage contract (contract), the inputs (inputs), the fp64
   reference (reference), what a tensor-core stage's binding computes from its arguments, on that
   reference (kernel_model), the chunked backward's algorithm the backward kernels follow, on that
   reference's inputs (backward_model), how errors are measured (metrics), this table.
1. tools: what works on those facts without knowing the ladder -- building
   extensions (build), calling them (extrun), reading and writing recorded
   results (results), timing (timing), FLA and FlashKDA as references (fla_ref).
2. the ladder: which stages exist and how to load one (stages).
3. measurement: what is measured on the stages -- checks, benchmarks and
   their shapes and regimes (bench), ablations (ablation).
4. views: what shows the measurements and the recorded figures -- plots
   (plotting), reports and README tables (report), the notebooks' calls
   (notebook), the notebook tests (nbcheck), the prose check (prose).
5. cli: the ``kdalab`` command line.
"""

LAYER_NAMES = ("facts", "tools", "ladder", "measurement", "views", "cli")

LAYERS = {
    "__init__": "facts",
    "layers": "facts",
    "paths": "facts",
    "contract": "facts",
    "inputs": "facts",
    "reference": "facts",
    "kernel_model": "facts",
    "backward_model": "facts",
    "metrics": "facts",
    "build": "tools",
    "extrun": "tools",
    "results": "tools",
    "timing": "tools",
    "fla_ref": "tools",
    "stages": "ladder",
    "checks": "measurement",
    "bench": "measurement",
    "ablation": "measurement",
    "plotting": "views",
    "report": "views",
    "notebook": "views",
    "nbcheck": "views",
    "prose": "views",
    "cli": "cli",
}


def rank(module: str) -> int:
    """The position of a module's layer (0 = facts ... 5 = cli)."""
    return LAYER_NAMES.index(LAYERS[module])
