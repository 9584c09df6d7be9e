"""Modules and data modules written as users write them, not to this project's protocol.

They are the subjects of tests/test_own_models.py: a module and a data module in the style of ashleve's
lightning-hydra-template (``ashleve_style``), and a GAN-like module with two optimizers under manual
optimization (``two_optimizers``). Lightning's own demo modules (``lightning.pytorch.demos``) are used as the
installed package ships them.
"""
