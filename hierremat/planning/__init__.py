"""Planning: each distinct stage's ILP menu of block options (menus), their compiled forms
(compiled), the fused-head form of the last stage (output_stage), and the chain's plan under a
budget (chain_plan: the chain DP over the stages' measured options)."""
