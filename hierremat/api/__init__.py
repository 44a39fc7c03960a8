"""The public entry points: ``remat`` for whole models (whole_model; a shape planned
in shape_planning, kept as planned_shape), ``plan``/``explore`` (explore),
``checkpoint_sequential``/``plan_sequential`` for chains of modules (sequential), and the
``python -m hierremat`` command line (cli). ``import hierremat as hr`` exposes them."""
