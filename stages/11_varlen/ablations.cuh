// ablations.cuh -- the ablation builds of this stage (stage.py ABLATIONS, common/ablation.py).
//
// Stage 11 has none. Its idea, packed sequences (cu_seqlens) and the caller's
// layouts and activations in one launch, is what a model needs to call the
// kernel at all, not a speed-up with a previous stage's code to switch back to:
// the stage's measurement is the packed call against the same sequences run one
// call each, and the default (B, T) call against stage 10 (README). Stage 10's
// four switches and their alternative code are not this stage's ideas and are
// left out (they stay in stages/10_smem_diet/ablations.cuh); every idea of stage
// 10 is on here, as it is in stage 10's default build.
//
// common.cuh includes this file (only there), as the stages before it do.

#pragma once
