"""``hf-pma card FOLDER``: (re)generate the model card (README.md) and the plot of a merged folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``card`` sub-command."""
    p = subparsers.add_parser(
        "card",
        help="(re)generate the model card and the training plot of a merged folder from its records",
        description=(
            "Write README.md (the model card) and pma_training.png in a merged folder from its "
            "pma_merge.json, pma_eval.json and pma_training.json."
        ),
    )
    p.add_argument("folder", help="the merged model folder (with pma_merge.json)")
    p.add_argument("--repo-id", default=None, help="Hub repo id shown in the loading snippet, e.g. my-org/my-model-pma")
    p.add_argument("--model-name", default=None, help="name shown as the card's title and in its model-index")
    p.add_argument("--license", default=None, help="license id for the card metadata, e.g. apache-2.0")
    p.add_argument("--language", default=None, nargs="+", help="language code(s) for the card metadata")
    p.add_argument("--template", default=None, help="a Jinja markdown template to use instead of the packaged one")
    p.add_argument("--no-plot", action="store_true", help="do not (re)draw pma_training.png")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Write the card; print its path."""
    from hf_pma.core.manifest import CARD_NAME, PLOT_NAME
    from hf_pma.publishing.card import build_model_card, write_model_card
    from hf_pma.publishing.hub import check_repo_id
    from hf_pma.utils.fs import check_output_file, hold_claim

    if args.repo_id is not None:
        check_repo_id(args.repo_id)
    # Under the merged folder's claim, from the first read of a record to the card written: a
    # merge --overwrite replacing the folder (it holds the claim until it is published) is waited
    # for, and the card then describes the merge it stands beside.
    with hold_claim(args.folder, what="merged folder"):
        # Every check before the first byte: the records (read and checked), the card rendered
        # from them, and the files it writes.
        build_model_card(
            args.folder,
            repo_id=args.repo_id,
            model_name=args.model_name,
            license=args.license,
            language=args.language,
            template=args.template,
        )
        check_output_file(Path(args.folder) / CARD_NAME, "the model card")
        if not args.no_plot:
            check_output_file(Path(args.folder) / PLOT_NAME, "the training plot")
        path = write_model_card(
            args.folder,
            repo_id=args.repo_id,
            plot=not args.no_plot,
            model_name=args.model_name,
            license=args.license,
            language=args.language,
            template=args.template,
        )
    from hf_pma.utils.text import write_line

    write_line(path)
    return 0
