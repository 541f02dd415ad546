"""Evaluating models: held-out LM metrics, lm-eval tasks, generated multiple-choice tasks, corpora."""
