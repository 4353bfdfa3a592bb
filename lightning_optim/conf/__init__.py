"""Hydra configs for the main job (``python -m lightning_optim.train``).

A python package so the tree ships inside the wheel and Hydra can find it from an installed copy.
Groups: optimizer/, strategy/, precision/, model/, data/, trainer/; the primary config is train.yaml.
"""
