"""Training EAGLE-3 drafters for a target Kestrel serves (`kestrel train-eagle3`): data, draft vocabulary, target
features, the trainable drafter, the training loop and the evaluation through the serving path."""
