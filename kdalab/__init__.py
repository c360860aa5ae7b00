"""kdalab: the KDA (Kimi Delta Attention) forward of the tutorial's last stage, and
the backward of next/13_backward, as a drop-in for fla-core 0.6.0's ``fla.ops.kda.chunk_kda``.

    from kdalab import chunk_kda          # FLA's signature; one clear error for what it does not run
    import kdalab.fla                     # FLA's own chunk_kda (and KDA layers) dispatch to it (training: FLA_KDALAB_TRAIN=1)
"""

from .op import chunk_kda, supported

__all__ = ["chunk_kda", "supported"]
