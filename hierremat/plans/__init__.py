"""Plan values and their simulator; never imports torch.

The values that cross layers: a block's operator graph (block_graph) and its options
(block_options), a chain's costs (costs), the stages' layout (stage_info), a schedule
(schedule), a solved chain (sequential_plan) and a whole model's plan (model_plan). The
simulator (simulate) replays a schedule over costs op by op: the chain DP's predictions must
equal its peak and time exactly.
"""
