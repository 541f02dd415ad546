"""Pre-train a causal LM in your own accelerate loop with PMA snapshots: gradient accumulation,
save_state / load_state (kill it, rerun with --resume), the merge swapped in for an evaluation,
and loss-spike recovery. Copy it, then put your model and data in place of the small ones here::

    accelerate launch scripts/pretrain_no_trainer.py --output_dir runs/loop
    accelerate launch scripts/pretrain_no_trainer.py --output_dir runs/loop --resume
    hf-pma merge runs/loop/pma --last 4 -o runs/loop/merged    # the tokenizer is runs/loop's
"""

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling as Collator
from transformers import LlamaConfig, LlamaForCausalLM, get_constant_schedule_with_warmup

from hf_pma import PMASnapshots, SpikeRecovery, pack_dataset, stdlib_documents, train_bpe_tokenizer
from hf_pma.utils.parsing import CommandLineParser

parser = CommandLineParser(description=__doc__.split("\n\n")[0])  # no abbreviations; a typo: the closest named
for flag, default in ("--output_dir", "runs/loop"), ("--max_steps", 200), ("--accumulation", 2), ("--save_every", 50):
    parser.add_argument(flag, default=default, type=type(default))
parser.add_argument("--resume", action="store_true", help="load_state from OUTPUT_DIR/state first")
args = parser.parse_args()
if args.resume and not (Path(args.output_dir) / "state").is_dir():
    parser.refuse(f"--resume: no saved state in {Path(args.output_dir) / 'state'}; run without --resume to start")
accelerator, out = Accelerator(gradient_accumulation_steps=args.accumulation), Path(args.output_dir)
set_seed(0)
docs = stdlib_documents(max_bytes=600_000)  # held out: the first 10 documents
with accelerator.main_process_first():  # the main process trains the tokenizer; the others read its cache
    tokenizer = train_bpe_tokenizer(docs[10:], vocab_size=512, cache_dir=out / "tokenizer-cache")
if accelerator.is_main_process:
    tokenizer.save_pretrained(out)  # the run folder: hf-pma merge and eval take the tokenizer from here
collate = Collator(tokenizer, mlm=False)
train = DataLoader(pack_dataset(docs[10:], tokenizer, 64), batch_size=4, collate_fn=collate)
heldout = DataLoader(pack_dataset(docs[:10], tokenizer, 64, max_blocks=16), batch_size=8, collate_fn=collate)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = get_constant_schedule_with_warmup(optimizer, 10)  # constant LR: what PMA's merge stands in for
model, optimizer, train, heldout, scheduler = accelerator.prepare(model, optimizer, train, heldout, scheduler)
pma = PMASnapshots(model, accelerator, optimizer=optimizer, lr_scheduler=scheduler, max_steps=args.max_steps,
                   output_dir=out, keep_last=12)  # fmt: skip
accelerator.register_for_checkpointing(pma)  # save_state / load_state carry its token count
recovery = SpikeRecovery(factor=3.0, window=20, last=3)
if args.resume:
    accelerator.load_state(out / "state")  # before the first pma.step; a finished run: no step left, evaluated
batches = accelerator.skip_first_batches(train, pma.global_step * args.accumulation % len(train))
while pma.global_step < args.max_steps:
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(), scheduler.step(), optimizer.zero_grad()
        pma.step(batch=batch)  # every micro-batch; a snapshot when the tokens pass a multiple of V
        if accelerator.sync_gradients:
            pma.check_for_spike(recovery, accelerator.gather(loss.detach()).mean().item())
            if pma.global_step % args.save_every == 0:
                accelerator.save_state(out / "state")
            if pma.global_step >= args.max_steps:
                break
    batches = train

model.eval()
with torch.no_grad():
    live = [accelerator.gather(model(**batch).loss).mean().item() for batch in heldout]
    with pma.swapped(model, last=4):  # the merge of the last 4 snapshots in the live model, then back
        merged = [accelerator.gather(model(**batch).loss).mean().item() for batch in heldout]
pma.end()
accelerator.print(f"held-out loss at step {pma.global_step}: live {sum(live) / len(live):.4f}, "
                  f"merge of the last 4 {sum(merged) / len(merged):.4f}")  # fmt: skip
