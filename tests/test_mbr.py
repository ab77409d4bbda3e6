"""mbr.py's rule: each candidate scored by its mean utility as the hypothesis against every candidate as the
reference, the highest chosen, the earlier on a tie. The reference computation is a plain loop over
sacreBLEU's sentence functions (the metric is sacreBLEU's; the rule is ours)."""
import pytest
import sacrebleu

from flaxformer_nmt.decoding import mbr

CANDIDATES = [  # the best-scored first, an outlier; the others agree with each other
    'a cat is sleeping on a red sofa .',
    'a dog runs across the green grass .',
    'a brown dog runs across the grass .',
    'the dog is running across the green grass .',
    'a dog runs on the grass .',
]


def expected_utilities(candidates, sentence_metric):
  return [sum(100.0 if i == j else sentence_metric(h, [r]).score for j, r in enumerate(candidates)) / len(candidates)
          for i, h in enumerate(candidates)]


@pytest.mark.parametrize('utility, sentence_metric', [('bleu', sacrebleu.sentence_bleu),
                                                      ('chrf', sacrebleu.sentence_chrf)])
def test_the_choice_is_the_candidate_of_highest_mean_utility_as_hypothesis(utility, sentence_metric):
  matrix = mbr.utility_matrix(CANDIDATES, utility)
  for i, h in enumerate(CANDIDATES):  # row: the hypothesis; column: the pseudo-reference
    for j, r in enumerate(CANDIDATES):
      if i != j:
        assert matrix[i, j] == pytest.approx(sentence_metric(h, [r]).score)
  means = expected_utilities(CANDIDATES, sentence_metric)
  chosen = mbr.select(CANDIDATES, utility)
  assert chosen == max(range(len(CANDIDATES)), key=lambda i: (means[i], -i)) and chosen != 0
  assert mbr.select(CANDIDATES[:1], utility) == 0


@pytest.mark.parametrize('utility, candidates', [
    ('bleu', ['a man rides a bike .', 'a man is riding a bicycle down the hill .', 'a man rides .']),
    ('chrf', ['a man rides a bike down a hill .', 'a man rides a bike .', 'a man rides a bike down a steep hill .'])])
def test_the_direction_of_the_utility_decides_where_its_transpose_would_not(utility, candidates):
  # Sentence metrics are not symmetric (brevity penalty, chrF's recall weight): the rule reads rows (the
  # candidate as the hypothesis), and for these candidates the columns would choose another.
  matrix = mbr.utility_matrix(candidates, utility)
  rows, columns = matrix.mean(axis=1), matrix.mean(axis=0)
  assert rows.argmax() != columns.argmax()
  assert mbr.select(candidates, utility) == rows.argmax()


def test_ties_go_to_the_earlier_candidate_and_bad_utilities_are_named():
  assert mbr.select(['one two three four', 'five six seven eight'], 'bleu') == 0  # nothing shared: a tie
  assert mbr.select(['x', 'a b c d e', 'a b c d e'], 'bleu') == 1
  assert mbr.select(['', ''], 'chrf') == 0
  with pytest.raises(ValueError, match="MBR utility 'ter'"):
    mbr.select(CANDIDATES[:1], 'ter')
  with pytest.raises(ValueError, match='at least one candidate'):
    mbr.select([], 'bleu')


@pytest.mark.parametrize('utility, sentence_metric', [('bleu', sacrebleu.sentence_bleu),
                                                      ('chrf', sacrebleu.sentence_chrf)])
def test_short_candidates_are_scored_with_the_metrics_sentence_defaults(utility, sentence_metric):
  # Candidates of fewer than four words: BLEU's effective order (sacreBLEU's sentence default) decides their
  # scores; the diagonal, a candidate against itself, is 100.
  candidates = ['a dog', 'a dog runs', 'the dog runs .', 'a dog runs on grass .', 'dog']
  matrix = mbr.utility_matrix(candidates, utility)
  for i, h in enumerate(candidates):
    for j, r in enumerate(candidates):
      assert matrix[i, j] == pytest.approx(100.0 if i == j else sentence_metric(h, [r]).score), (h, r)
  means = expected_utilities(candidates, sentence_metric)
  assert mbr.select(candidates, utility) == max(range(len(candidates)), key=lambda i: (means[i], -i))
