// kda_profile.cuh -- clock64 region timers for the CUDA stages.
//
// Built with -DKDA_PROFILE (the stage's profile variant), a kernel adds the
// cycles it spends in each named region to an int64 buffer laid out as
// [slot, KDA_MAX_REGIONS]; a slot is usually the block index. Without the flag
// every macro below expands to nothing, so the normal build is the same code
// minus the timers. Python (common.profiling) turns the buffer into cycles per
// region: the mean over the slots that recorded that region.
//
//   KDA_PROF_START(t);                         // t = clock64()
//   ... region work ...
//   KDA_PROF_LAP(prof, slot, REGION_ID, t);    // prof[slot][REGION_ID] += now - t; t = now
//
// Only the thread that calls KDA_PROF_LAP records (guard it with e.g.
// `if (threadIdx.x == 0)` when a whole block times a region between barriers).
#pragma once

#define KDA_MAX_REGIONS 20

#ifdef KDA_PROFILE
#define KDA_PROF_START(t) long long t = clock64()
#define KDA_PROF_RESET(t) t = clock64()
#define KDA_PROF_LAP(prof, slot, region, t)                                              \
  do {                                                                                  \
    long long _kda_now = clock64();                                                     \
    if (prof != nullptr)                                                                \
      atomicAdd(reinterpret_cast<unsigned long long*>(                                  \
                    &(prof)[(long long)(slot) * KDA_MAX_REGIONS + (region)]),           \
                static_cast<unsigned long long>(_kda_now - (t)));                       \
    t = _kda_now;                                                                       \
  } while (0)
#else
#define KDA_PROF_START(t) \
  do {                    \
  } while (0)
#define KDA_PROF_RESET(t) \
  do {                    \
  } while (0)
#define KDA_PROF_LAP(prof, slot, region, t) \
  do {                                      \
  } while (0)
#endif
