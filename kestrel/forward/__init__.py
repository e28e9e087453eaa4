"""Building and running a runner: startup (weights, KV sizing, compile-ahead), ModelRunner.execute, the decode,
prefill, verify and drafter CUDA graphs (and the draft tree they are captured for), the sampler."""
