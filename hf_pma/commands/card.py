"""``hf-pma card FOLDER``: (re)generate the model card (README.md) and the plot of a merged folder."""

from __future__ import annotations

import argparse


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
    from hf_pma.publishing.card import write_model_card
    from hf_pma.publishing.hub import check_repo_id

    if args.repo_id is not None:
        check_repo_id(args.repo_id)
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
