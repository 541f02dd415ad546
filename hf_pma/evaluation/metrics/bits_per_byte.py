"""Language-modelling metrics from per-document sums: loss, perplexity, bits-per-byte.

An `evaluate` module shipped with hf-pma, for your own sums: ``hf_pma.evaluation.metrics.load_metric("bits_per_byte")``
builds it from this installed file (never ``evaluate.load`` by name, which fetches code from the Hub,
nor by path, which imports a copy from ``HF_HOME/modules``). hf-pma itself computes with
:func:`hf_pma.evaluation.metrics.totals.language_model_totals`, without `evaluate`.
"""

import datasets
import evaluate

from hf_pma.evaluation.metrics.totals import language_model_totals

_DESCRIPTION = """\
Held-out language-modelling metrics of a causal LM, computed from one row per document:
the summed negative log-likelihood of its scored tokens (in nats), the number of scored tokens
and the number of UTF-8 bytes of its text.

loss = sum(nll) / sum(tokens) (mean NLL per token, nats), perplexity = exp(loss),
bits_per_byte = sum(nll) / ln(2) / sum(bytes).

Bits-per-byte does not depend on the tokenizer (the same text always has the same number of
bytes), so it compares models with different tokenizers; loss and perplexity do not.
"""

_KWARGS_DESCRIPTION = """
Args:
    nll (`list` of `float`): summed negative log-likelihood of each document's scored tokens, in nats.
    tokens (`list` of `int`): number of scored tokens of each document.
    bytes (`list` of `int`): number of UTF-8 bytes of each document's text.
Returns:
    loss (`float`), perplexity (`float`), bits_per_byte (`float`), tokens (`int`), bytes (`int`).
Examples:
    >>> metric = hf_pma.evaluation.metrics.load_metric("bits_per_byte")
    >>> metric.compute(nll=[6.931471805599453], tokens=[5], bytes=[10])["bits_per_byte"]
    1.0
"""

_CITATION = """\
@article{gao2020pile,
  title={The {P}ile: An 800{GB} Dataset of Diverse Text for Language Modeling},
  author={Gao, Leo and others},
  journal={arXiv preprint arXiv:2101.00027},
  year={2020}
}
"""


class BitsPerByte(evaluate.Metric):
    """Loss, perplexity and bits-per-byte from per-document NLL sums and counts."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "nll": datasets.Value("float64"),
                    "tokens": datasets.Value("int64"),
                    "bytes": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, nll, tokens, bytes):  # noqa: A002 - the feature is called "bytes"
        return language_model_totals(nll, tokens, bytes)
