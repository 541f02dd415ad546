"""PMATrainer with push_to_hub=True, run in its own process so HF_ENDPOINT (read at import time)
points at the local Hub stand-in. Usage: push_trainer.py OUTPUT_DIR REPO_ID"""

from __future__ import annotations

import sys

from hf_pma import PMATrainer, PMATrainingArguments
from tests.helpers.training import lm_setup, quiet_args


def main() -> None:
    output_dir, repo_id = sys.argv[1], sys.argv[2]
    model, tokenizer, train, evaluation, collator = lm_setup()
    args = PMATrainingArguments(
        output_dir=output_dir,
        **quiet_args(max_steps=8),
        pma_interval_tokens=256,
        pma_window=3,
        push_to_hub=True,
        hub_model_id=repo_id,
    )
    trainer = PMATrainer(
        model,
        args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.push_to_hub()  # what the Trainer itself pushes: the live model, to main
    print("merged:", trainer.pma_merged_dir)


if __name__ == "__main__":
    main()
