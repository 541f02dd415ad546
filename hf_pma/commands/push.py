"""``hf-pma push FOLDER --repo-id ID``: upload a (merged) model folder, with its card, to the Hub."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``push`` sub-command."""
    p = subparsers.add_parser(
        "push",
        help="push a merged model folder (and its card) to the Hugging Face Hub",
        description=(
            "Upload a model folder to a Hub repo through HfApi (create_repo, create_commit). The token "
            "comes from HF_TOKEN or `hf auth login`, the Hub from HF_ENDPOINT. A merged folder without "
            "README.md gets its card written first. Exactly the regular files inside the folder are uploaded: a "
            "symbolic link that leads out of it, a FIFO or a device, a malformed record or a file holding the "
            "token stops the push before any request."
        ),
    )
    p.add_argument("folder", help="the model folder to push (config.json + weights)")
    p.add_argument("--repo-id", required=True, help="target repo, e.g. my-org/my-model-pma")
    p.add_argument("--private", action="store_true", help="create the repo private (an existing repo keeps its visibility)")
    p.add_argument("--revision", default=None, help="branch to push to (created from main when missing)")
    p.add_argument("--commit-message", default=None, help="commit message (default: 'Upload FOLDER with hf-pma')")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Push the folder; print the commit URL."""
    from hf_pma.publishing.hub import push_folder_to_hub

    url = push_folder_to_hub(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
    )
    from hf_pma.utils.text import write_line

    write_line(url)
    return 0
