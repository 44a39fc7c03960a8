"""Blocks, and what is done per block: a model captured as one ATen-level fx graph (torch.export; hierremat.blocks.capture),
its nodes described (nodes), cut into a chain of stages (segment; in-place writes across a cut
made out of place: boundary_writes), each stage's joint
forward+backward graph traced (joint), and the operator variants' rewrites of those graphs
(hierremat.blocks.variants). It runs the model only to trace it: measuring is the runtime's,
the operators the rewrites insert are hierremat.ops'."""
