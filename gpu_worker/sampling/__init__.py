"""From a step's logits to its tokens: the sampler and what requests change in their rows of logits."""
