"""What a forward pass takes and gives (ForwardBatch), the runner and its CUDA graphs, the sampler."""
