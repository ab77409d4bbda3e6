"""Minimum Bayes risk (MBR) selection: of a sentence's candidate translations, the one that agrees most with the
others, instead of the one the model scores highest (Kumar and Byrne 2004; Eikema and Aziz 2020; Freitag et al.
2022, "High Quality Rather than High Model Probability").

The candidates are the search's n best (decode.py, `--n_best`) or samples of the model (`--sampling`). Each
candidate h is scored by its mean utility against every candidate as a pseudo-reference, itself included:
  expected_utility(h) = (1 / N) * sum_j utility(h, candidate_j)
With samples, that mean estimates the expected utility under the model's distribution, and a translation
sampled twice counts twice. Itself included, every candidate gets the same utility(h, h), taken as 100, so it
changes no choice. Ties go to the earlier candidate: the search's better-scored one.

Utilities are sacreBLEU's sentence-level metrics: 'bleu' (13a tokenization; effective n-gram order, so that a
short sentence with no 4-gram match still scores above 0) and 'chrf' (character 6-grams, beta 2). The utility
is the metric being reported in 'bleu''s case, so part of its gain can be the metric's own taste; 'chrf' is
the check.
"""
import numpy as np
import sacrebleu

UTILITIES = ('bleu', 'chrf')


def metric(utility):
  """The sacreBLEU metric of a utility's name; ValueError for an unknown one."""
  if utility == 'bleu':
    return sacrebleu.BLEU(effective_order=True)
  if utility == 'chrf':
    return sacrebleu.CHRF()
  raise ValueError(f'MBR utility {utility!r}: use one of {UTILITIES}')


def utility_matrix(candidates, utility='bleu'):
  """[N, N] array: entry (i, j) is the utility of candidates[i] as a hypothesis against candidates[j] as its
  reference (sentence BLEU and chrF are not symmetric)."""
  scorer = metric(utility)
  n = len(candidates)
  matrix = np.empty((n, n))
  for i, hypothesis in enumerate(candidates):
    for j, reference in enumerate(candidates):
      matrix[i, j] = 100.0 if i == j else scorer.sentence_score(hypothesis, [reference]).score
  return matrix


def select(candidates, utility='bleu'):
  """The index of the candidate with the highest mean utility against all the candidates (the first on a tie)."""
  if not candidates:
    raise ValueError('MBR needs at least one candidate')
  return int(np.argmax(utility_matrix(candidates, utility).mean(axis=1)))
