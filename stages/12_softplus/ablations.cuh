// ablations.cuh -- the ablation builds of this stage (stage.py ABLATIONS, common/ablation.py).
//
// Stage 12 has none. Its idea, the pairwise products, is switched at run time
// instead (KdaFwdParams::pairwise, stage.py pairwise()): the bounded gate runs
// either way in one build, which is how the idea's cost is measured (README).
// Stage 10's four switches are not this stage's ideas (they stay in
// stages/10_smem_diet/ablations.cuh); every idea of stage 10 is on here.
//
// common.cuh includes this file (only there), as the stages before it do.

#pragma once
