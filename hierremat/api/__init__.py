"""The public entry points: ``remat``/``plan``/``explore`` for whole models (whole_model),
``checkpoint_sequential``/``plan_sequential`` for chains of modules (sequential), and the
``python -m hierremat`` command line (cli). ``import hierremat as hr`` exposes them."""
