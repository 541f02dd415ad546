"""Model card templates of hf-pma, shipped in the wheel as ``hf_pma.model_cards``.

The templates are Jinja markdown files rendered by
:func:`hf_pma.publishing.card.build_model_card` through ``huggingface_hub.ModelCard.from_template``
(setup.cfg maps this top-level folder to the package ``hf_pma.model_cards``). This file only makes
the folder a regular package: :func:`hf_pma.publishing.card.template_path` reads a source
checkout's ``model_cards/`` directly, and an installed wheel's through ``importlib.resources``.
"""
