"""Surrogate training by KVzip+ distillation: targets from a real model, then a Linear or MLP fit."""
