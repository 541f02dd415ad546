"""``PMATrainer`` and ``PMATrainingArguments`` (merged evaluation, PMA-init, spike recovery), pre-training data."""
