// ablations.cuh -- the ablation builds of this stage (stage.py ABLATIONS, common/ablation.py).
//
// Stage 12 has none. Its ideas, the pairwise products and u in two halves, are
// switched at run time instead (KdaFwdParams::pairwise and u_halves, stage.py
// pairwise() and u_halves()): each runs either way in one build on the same inputs,
// which is how each idea is measured (README).
// Stage 10's four switches are not this stage's ideas (they stay in
// stages/10_smem_diet/ablations.cuh); every idea of stage 10 is on here.
//
// common.cuh includes this file (only there), as the stages before it do.

#pragma once
