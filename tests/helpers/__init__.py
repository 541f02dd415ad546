"""What the tests share, one module per job (nothing here is a test; nothing touches the network):

| module | holds |
|---|---|
| ``repo`` | ``REPO_ROOT``, ``DIST_DIR``, ``load_script`` (a script that is no package module) |
| ``models`` | tiny Llama configs and models, the locally trained tokenizer, model folders and their weights |
| ``data`` | sample text, blocks and documents of it, ``TokenDataset`` and ``pad_collate``, generated tasks |
| ``training`` | ``quiet_args`` / ``make_args`` (fast CPU Trainer settings), ``lm_setup``, ``train_small``, ``WeightRecorder``, ``StopAt`` |
| ``markers`` | ``require_*`` markers for the optional extras |
| ``mounts`` | a folder made read-only for real (a bind mount) |
| ``output`` | reading tables (markdown, plain text) and log messages |
| ``cli`` | ``run_cli``, the one way tests run ``hf-pma`` |
| ``launcher`` | ``launch``, the one way tests start several processes; shared launches and their scenarios |
| ``audit`` | Python audit events as a witness of what code opened, listed or started |
| ``hub_server`` | a stand-in for the Hugging Face Hub on 127.0.0.1 |
| ``pma_records`` | merged folders with known records (card, plot, push tests) |
| ``snapshot_runs`` | synthetic run folders of snapshots with a manifest |
| ``sharded_files`` | sharded (per-rank) snapshot folders cut by hand in every layout |
| ``pretrain_runs`` | scripts/pretrain.py as the tests run it |

The scripts that tests launch are in ``tests/dist/``.
"""
