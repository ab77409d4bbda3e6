"""Validation BLEU while training, the best checkpoint, and decode/compare --checkpoint best."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import sacrebleu

import in_process
from conftest import small_config, subprocess_env
from flaxformer_nmt import compare as compare_command
from flaxformer_nmt import config as config_lib
from flaxformer_nmt import decode as decode_command
from flaxformer_nmt import evaluate as evaluate_command
from flaxformer_nmt.checkpointing import best as best_checkpoint
from flaxformer_nmt.checkpointing import checkpoints as checkpoints_lib
from flaxformer_nmt.config import ConfigError
from flaxformer_nmt.decoding import translator as decode
from flaxformer_nmt.evaluation import bleu as evaluate
from flaxformer_nmt.training import warm_start


def read_metrics(workdir):
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


def test_training_logs_validation_bleu_and_keeps_the_best_checkpoint(trained_toy):
  """The session's toy (conftest.trained_toy_config): validation BLEU at steps 200 and 400, the second above 0
  (a model that translates: plumbing that wrote empty or misaligned lines would score 0 there too)."""
  workdir, data, tok_dir = trained_toy, trained_toy.parent / 'data', trained_toy.parent / 'tok'
  records = [r for r in read_metrics(workdir) if 'eval/bleu' in r]
  assert [r['step'] for r in records] == [200, 400]
  assert records[-1]['eval/bleu'] > 5 and records[-1]['eval/tok_bleu'] > 5
  sources = (data / 'valid.en').read_text().splitlines()
  references = (data / 'valid.de').read_text().splitlines()
  tok_references = (tok_dir / 'valid.de').read_text().splitlines()
  for record in records:
    assert record['eval/bleu_signature'].startswith('nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp')
    assert record['eval/bleu_seconds'] > 0 and record['eval/bleu_sentences'] == 20
    hypotheses = (workdir / 'eval' / f'hyp_{record["step"]}.txt').read_text().split('\n')[:-1]
    assert len(hypotheses) == 20
    # The logged numbers are those of the written lines, scored here independently.
    score = sacrebleu.corpus_bleu(hypotheses, [references])
    assert record['eval/bleu'] == pytest.approx(score.score, abs=1e-9)
    assert record['eval/bleu_length_ratio'] == pytest.approx(score.sys_len / score.ref_len)
    tok_hyp = evaluate.moses_lowercase_tokenize(hypotheses, 'de')
    assert record['eval/tok_bleu'] == pytest.approx(
        sacrebleu.corpus_bleu(tok_hyp, [tok_references], tokenize='none', force=True).score, abs=1e-9)

  # The lines are those the trained parameters give offline (in-memory decode == decode of the checkpoint).
  offline = decode.Translator(workdir, checkpoint='400').translate(sources, beam_size=0)
  assert offline == (workdir / 'eval' / 'hyp_400.txt').read_text().split('\n')[:-1]

  # The best evaluation's parameters are kept apart from the rotated checkpoints and load as 'best'.
  values = {r['step']: r['eval/bleu'] for r in records}
  best_step = max(values, key=lambda s: (values[s], -s))  # the first of equal values stays best
  info = best_checkpoint.read_info(workdir)
  assert info['step'] == best_step and info['value'] == pytest.approx(values[best_step])
  assert info['metric'] == 'bleu' and info['metrics']['eval/tok_bleu'] == pytest.approx(
      next(r['eval/tok_bleu'] for r in records if r['step'] == best_step))
  assert checkpoints_lib.saved_steps(workdir) == [300, 400]
  assert [p.name for p in (workdir / 'best').iterdir() if p.name.startswith('params')] == [f'params_{best_step}']
  best = decode.Translator(workdir, checkpoint='best')
  assert best.checkpoint.startswith(f'the best checkpoint (step {best_step}, bleu ')
  best_lines = (workdir / 'eval' / f'hyp_{best_step}.txt').read_text().split('\n')[:-1]
  assert best.translate(sources, beam_size=0) == best_lines


def test_decode_and_compare_read_the_best_checkpoint(trained_toy, tmp_path):
  workdir, data = trained_toy, trained_toy.parent / 'data'
  sources = (data / 'valid.en').read_text().splitlines()
  references = (data / 'valid.de').read_text().splitlines()
  best = decode.Translator(workdir, checkpoint='best')
  # decode --checkpoint best from the command line.
  (tmp_path / 'in.en').write_text('\n'.join(sources[:3]) + '\n')
  result = in_process.run(decode_command, [f'--workdir={workdir}', '--checkpoint=best',
                                           f'--input={tmp_path / "in.en"}', '--greedy'])
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split('\n')[:-1] == best.translate(sources[:3], beam_size=0)

  # compare (a real `python -m` run): best, the last two averaged in memory, and latest, in one table on the
  # same sentences.
  (tmp_path / 'ref.de').write_text('\n'.join(references) + '\n')
  (tmp_path / 'all.en').write_text('\n'.join(sources) + '\n')
  result = subprocess.run([sys.executable, '-m', 'flaxformer_nmt.compare', f'--workdir={workdir}',
                           '--checkpoints=best,last:2,latest', f'--input={tmp_path / "all.en"}',
                           f'--ref={tmp_path / "ref.de"}', '--beam_size=0'],
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [[cell.strip() for cell in line.strip('|').split('|')] for line in result.stdout.splitlines()
          if line.startswith('| ') and '---' not in line][1:]
  assert [r[0] for r in rows] == ['best', 'last:2', 'latest']
  assert rows[1][1] == 'the average of checkpoints [300, 400]'
  latest_hyp = (workdir / 'eval' / 'hyp_400.txt').read_text().split('\n')[:-1]
  assert float(rows[2][3]) == pytest.approx(sacrebleu.corpus_bleu(latest_hyp, [references]).score, abs=0.005)


def test_references_and_checkpoints_are_checked_before_anything_is_translated(trained_toy, tmp_path):
  """decode's --reference and compare's --checkpoints were read only after the translating: a missing or
  misaligned reference, or a step the workdir does not have, cost a whole decode (and decode's output file)
  first."""
  workdir, data = trained_toy, trained_toy.parent / 'data'
  sources = (data / 'valid.en').read_text().splitlines()[:2]
  (tmp_path / 'in.en').write_text('\n'.join(sources) + '\n')
  (tmp_path / 'three.de').write_text('a\nb\nc\n')
  (tmp_path / 'bad.de').write_bytes(b'ein hund .\nzwei \xff katzen .\n')
  out = tmp_path / 'out.de'
  for reference, message in ((tmp_path / 'missing.de', f'error: --reference {tmp_path / "missing.de"}: file not '
                              'found'),
                             (tmp_path / 'three.de', f'error: --reference {tmp_path / "three.de"} has 3 lines but '
                              f'--input {tmp_path / "in.en"} has 2'),
                             (tmp_path / 'bad.de', f'error: --reference {tmp_path / "bad.de"}:2: invalid UTF-8')):
    result = in_process.run(decode_command, [f'--workdir={workdir}', '--checkpoint=latest', '--greedy',
                                             f'--input={tmp_path / "in.en"}', f'--output={out}',
                                             f'--reference={reference}'])
    assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
    assert not out.exists() and 'sentences/s' not in result.stderr

  (tmp_path / 'ref.de').write_text('\n'.join((data / 'valid.de').read_text().splitlines()[:2]) + '\n')
  result = in_process.run(compare_command, [f'--workdir={workdir}', '--checkpoints=latest,12345', '--beam_size=0',
                                            f'--input={tmp_path / "in.en"}', f'--ref={tmp_path / "ref.de"}'])
  assert result.returncode == 1 and 'no checkpoint 12345 in' in result.stderr, result.stderr[-2000:]
  assert '| latest |' not in result.stdout
  for flags_given, message in ((['--ref=x.de'], '--ref is the references of --input'),
                               ([f'--input={tmp_path / "in.en"}', '--ref=x.de', '--split=valid'], 'give one'),
                               ([f'--rerank_workdir={workdir}', '--rerank_weight='], '--rerank_weight is empty')):
    result = in_process.run(compare_command, [f'--workdir={workdir}'] + flags_given)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_validation_scores_and_writes_the_lines_it_is_given_in_the_models_case(trained_toy, tmp_path, monkeypatch):
  """ValidationBleu.evaluate with the search replaced by given lines: short lines (the brevity penalty is not the
  length ratio), scored by sacreBLEU here, without tokenized references (no tok_bleu in the metrics: NaN is not
  JSON); then a model of config.lowercase whose lines come out in capitals scores as if lowercase (case:lc).
  Catches the length ratio logged as the brevity penalty, a NaN tok_bleu kept and a cased score of such a model."""
  import jax  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.runtime import sharding  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import validation  # pylint: disable=g-import-not-at-top
  references = (trained_toy.parent / 'data' / 'valid.de').read_text().splitlines()[:5]
  config = workdir_lib.load_config(trained_toy)
  config.eval_bleu_max_sentences, config.eval_bleu_tok_ref_dir = 5, ''
  tokenizer = tokenizer_lib.Tokenizer(trained_toy / 'vocab.model')
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  short = [' '.join(line.split()[:-1]) for line in references]
  monkeypatch.setattr(validation.ValidationBleu, 'translate', lambda self, params: short)
  metrics = validation.ValidationBleu(config, tokenizer, tmp_path / 'w', mesh).evaluate(7, params=None)
  score = sacrebleu.corpus_bleu(short, [references])
  assert score.bp < 1 and score.bp != pytest.approx(score.sys_len / score.ref_len)
  assert metrics['eval/bleu'] == pytest.approx(score.score, abs=1e-9)
  assert metrics['eval/bleu_brevity_penalty'] == pytest.approx(score.bp)
  assert metrics['eval/bleu_length_ratio'] == pytest.approx(score.sys_len / score.ref_len)
  assert 'eval/tok_bleu' not in metrics and metrics['eval/bleu_sentences'] == 5
  assert metrics['eval/bleu_signature'].startswith('nrefs:1|case:mixed|')
  assert (tmp_path / 'w' / 'eval' / 'hyp_7.txt').read_text() == ''.join(line + '\n' for line in short)
  config.lowercase = True
  monkeypatch.setattr(validation.ValidationBleu, 'translate', lambda self, params: [r.upper() for r in references])
  metrics = validation.ValidationBleu(config, tokenizer, tmp_path / 'w', mesh).evaluate(8, params=None)
  assert metrics['eval/bleu'] == pytest.approx(100.0) and '|case:lc|' in metrics['eval/bleu_signature']


def test_references_are_read_line_for_line_as_the_decode_command_reads_its_input(tmp_path):
  """A lone \\r inside a line is text, not a line end (the decode command splits its input at \\n alone): read
  in text mode, a reference with one gained a line and every later line was scored against the wrong one."""
  path = tmp_path / 'ref.de'
  path.write_bytes(b'ein hund .\r\nzwei\rkatzen .\n\ndrei \xc3\xa4pfel')
  assert evaluate.read_text(path) == ['ein hund .', 'zwei\rkatzen .', '', 'drei \u00e4pfel']
  path.write_bytes(b'ok\nzwei \xff katzen .\n')
  with pytest.raises(ValueError, match=f'{path}:2: invalid UTF-8'):
    evaluate.read_text(path)


def test_validation_reads_the_tokenized_reference_of_each_pair_past_a_skipped_one(trained_toy, tmp_path):
  """With config.skip_bad_pairs, a bad validation pair is dropped; the tokenized references, read from their own
  file by line, took the first N lines and paired every later sentence with the line before its own."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.runtime import sharding  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import validation  # pylint: disable=g-import-not-at-top
  data, tok = tmp_path / 'data', tmp_path / 'tok'
  shutil.copytree(trained_toy.parent / 'data', data)
  shutil.copytree(trained_toy.parent / 'tok', tok)
  targets = (data / 'valid.de').read_text().splitlines()
  (data / 'valid.de').write_text('\n'.join(targets[:2] + [''] + targets[3:]) + '\n')  # line 3: one side empty
  config = workdir_lib.load_config(trained_toy)
  config.data_dir, config.eval_bleu_tok_ref_dir, config.skip_bad_pairs = str(data), str(tok), True
  config.eval_bleu_max_sentences = 6
  tokenizer = tokenizer_lib.Tokenizer(trained_toy / 'vocab.model')
  bleu = validation.ValidationBleu(config, tokenizer, tmp_path / 'w', sharding.make_mesh(devices=jax.devices()[:1]))
  tok_lines = (tok / 'valid.de').read_text().splitlines()
  assert bleu.references == targets[:2] + targets[3:7]
  assert bleu.tok_references == tok_lines[:2] + tok_lines[3:7]


def test_validation_refuses_tokenized_references_of_another_corpus(trained_toy, tmp_path):
  """A run on a new data_dir that kept the config's eval_bleu_tok_ref_dir (another corpus's references) scored
  lowercased tokenized BLEU against them without a word whenever they had at least as many lines."""
  import shutil  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.checkpointing import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import corpus as data_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.runtime import sharding  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import validation  # pylint: disable=g-import-not-at-top
  tok = tmp_path / 'tok'
  shutil.copytree(trained_toy.parent / 'tok', tok)
  config = workdir_lib.load_config(trained_toy)
  config.data_dir, config.eval_bleu_tok_ref_dir = str(trained_toy.parent / 'data'), str(tok)
  config.eval_bleu_max_sentences = 4
  tokenizer = tokenizer_lib.Tokenizer(trained_toy / 'vocab.model')
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  tok_lines = (tok / 'valid.de').read_text().splitlines()
  assert len(validation.ValidationBleu(config, tokenizer, tmp_path / 'w', mesh).tok_references) == 4
  for lines in (tok_lines + ['ein weiterer satz .'], tok_lines[:-1]):
    (tok / 'valid.de').write_text('\n'.join(lines) + '\n')
    with pytest.raises(data_lib.DataError, match=f'{tok / "valid.de"}: {len(lines)} lines, but valid has '
                       f'{len(tok_lines)} .*eval_bleu_tok_ref_dir'):
      validation.ValidationBleu(config, tokenizer, tmp_path / 'w', mesh)


def test_tokenized_bleu_lowercases_the_tokenized_references_too():
  """'lowercased moses-tokenized' BLEU lowercased the hypotheses alone: a cased tokenized reference scored a
  perfect translation 22.09 (the official lc.norm.tok files are lowercase already)."""
  hypotheses = ['Ein Hund läuft über die grüne Wiese.', 'Zwei Männer spielen Fußball im Park.']
  cased_references = ['Ein Hund läuft über die grüne Wiese .', 'Zwei Männer spielen Fußball im Park .']
  score, description = evaluate.tokenized_bleu(hypotheses, cased_references, 'de')
  assert score == pytest.approx(100.0)
  assert '|case:lc|' in description  # the score is case-insensitive: its signature says so


# Lines of Multi30k's valid and test2016 (German) beside their official lc.norm.tok form: the normalization of
# German quotes, XML escapes of quotes and apostrophes, hyphens and parentheses kept.
OFFICIAL_TOKENIZED = (
    ('Eine Frau hält einen großen Scheck für "Kids\' Food Basket".',
     'eine frau hält einen großen scheck für &quot; kids &apos; food basket &quot; .'),
    ('Zwei Jungen essen ihr McDonald\'s-Menü im Außenbereich, umgeben von vielen anderen Leuten.',
     'zwei jungen essen ihr mcdonald &apos; s-menü im außenbereich , umgeben von vielen anderen leuten .'),
    ('Zwei Mädchen (eine in Blau und die andere in Pink) liefern sich ein Rennen auf Rollschuhen.',
     'zwei mädchen ( eine in blau und die andere in pink ) liefern sich ein rennen auf rollschuhen .'),
    ('Eine junge Frau in „Straßenkleidung“ und Stiefeln führt eine Ballettübung an einem See aus.',
     'eine junge frau in &quot; straßenkleidung &quot; und stiefeln führt eine ballettübung an einem see aus .'),
    ('Ein Jugendlicher in einem schwarzen T-Shirt mit dem Aufdruck "Asian Pacific 2007" sitzt und spielt eine '
     'Trommel.', 'ein jugendlicher in einem schwarzen t-shirt mit dem aufdruck &quot; asian pacific 2007 &quot; '
     'sitzt und spielt eine trommel .'),
    # A closing quote after the final period: normalize-punctuation.perl moves the period behind it.
    ('Ein Mann in einem blauen Hemd hält ein Schild, auf dem steht: „Come on now ... what\'s gayer than tea.“',
     'ein mann in einem blauen hemd hält ein schild , auf dem steht : &quot; come on now ... what &apos; s gayer '
     'than tea &quot; .'),
)


def test_the_moses_recipe_gives_the_official_tokenized_references():
  """The hypotheses' tokenization is the references': the same lines through moses_lowercase_tokenize equal
  Multi30k's lc.norm.tok lines (a recipe without the escapes, the punctuation normalization or the lowercasing
  would score translations against text they can never match)."""
  raw, official = zip(*OFFICIAL_TOKENIZED)
  assert evaluate.moses_lowercase_tokenize(raw, 'de') == list(official)


def test_evaluate_lowercase_scores_ignore_case_and_the_tokenized_score_uses_the_language_given(tmp_path):
  """evaluate on lowercased translations of cased references: cased sacreBLEU and chrF as sacreBLEU's defaults give
  them, with --lowercase 100 and case:lc; the tokenized score of the raw lines against their official lc.norm.tok
  form is 100 through the German recipe (--lang de). Catches --lowercase not passed on, or dropped by the BLEU or the
  chrF scorer, and the recipe run for another language than --lang (English keeps a period before a closing
  quote)."""
  raw, official = zip(*OFFICIAL_TOKENIZED)
  hypotheses = [line.lower() for line in raw]
  for name, lines in (('hyp.de', hypotheses), ('ref.de', raw), ('tok.de', official)):
    (tmp_path / name).write_text(''.join(line + '\n' for line in lines))
  args = [f'--hyp={tmp_path / "hyp.de"}', f'--ref={tmp_path / "ref.de"}', f'--tok_ref={tmp_path / "tok.de"}']
  cased, lowered = (in_process.run(evaluate_command, args + extra) for extra in ([], ['--lowercase']))
  assert cased.returncode == 0 and lowered.returncode == 0, cased.stderr[-2000:] + lowered.stderr[-2000:]
  bleu, chrf = sacrebleu.corpus_bleu(hypotheses, [raw]).score, sacrebleu.corpus_chrf(hypotheses, [raw]).score
  assert bleu < 90 and chrf < 95  # the capitals count
  assert f'BLEU = {bleu:.2f}  (nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp' in cased.stdout, cased.stdout
  assert f'chrF = {chrf:.2f}  (nrefs:1|case:mixed' in cased.stdout, cased.stdout
  assert 'BLEU = 100.00  (nrefs:1|case:lc|eff:no|tok:13a|smooth:exp' in lowered.stdout, lowered.stdout
  assert 'chrF = 100.00  (nrefs:1|case:lc' in lowered.stdout, lowered.stdout
  for result in (cased, lowered):
    assert 'BLEU = 100.00  (lowercased moses-tokenized (de) |' in result.stdout, result.stdout


def test_evaluate_names_the_files_whose_lines_differ_and_refuses_stray_arguments(tmp_path):
  (tmp_path / 'hyp.de').write_text('a\nb\n')
  (tmp_path / 'ref.de').write_text('a\nb\nc\n')
  result = in_process.run(evaluate_command, [f'--hyp={tmp_path / "hyp.de"}', f'--ref={tmp_path / "ref.de"}'])
  assert result.returncode == 1, result.stderr
  assert f'error: --ref {tmp_path / "ref.de"} has 3 lines but --hyp {tmp_path / "hyp.de"} has 2' in result.stderr
  result = in_process.run(evaluate_command, [f'--hyp={tmp_path / "hyp.de"}', f'--ref={tmp_path / "hyp.de"}',
                                             str(tmp_path / 'other.de')])
  assert result.returncode != 0 and 'unexpected arguments' in result.stderr, result.stderr
  result = in_process.run(evaluate_command, [f'--hyp={tmp_path / "hyp.de"}', f'--ref={tmp_path / "hyp.de"}'])
  assert result.returncode == 0 and 'chrF = 100.00' in result.stdout, result.stderr


def test_evaluate_names_the_flag_of_a_file_it_cannot_read_and_a_language_moses_has_no_rules_for(tmp_path):
  # A directory was a bare "error: [Errno 21] Is a directory: '...'" naming no flag; --lang xx scored the
  # tokenized BLEU with English rules and said nothing.
  (tmp_path / 'hyp.de').write_text('ein hund .\n')
  (tmp_path / 'bad.de').write_bytes(b'ein hund .\n\xff\n')
  (tmp_path / 'folder').mkdir()
  good = str(tmp_path / 'hyp.de')
  for args, line in (
      ([f'--hyp={tmp_path / "folder"}', f'--ref={good}'], f'error: --hyp {tmp_path / "folder"}: Is a directory'),
      ([f'--hyp={good}', f'--ref={tmp_path / "missing"}'], f'error: --ref {tmp_path / "missing"}: file not found'),
      ([f'--hyp={good}', f'--ref={good}', f'--tok_ref={tmp_path / "bad.de"}'],
       f'error: --tok_ref {tmp_path / "bad.de"}:2: invalid UTF-8 (invalid start byte at byte 0)')):
    result = in_process.run(evaluate_command, args)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [line], result.stderr[-2000:]
  result = in_process.run(evaluate_command, [f'--hyp={good}', f'--ref={good}', f'--tok_ref={good}', '--lang=xx'])
  assert result.returncode == 1 and result.stdout == '', result.stderr[-2000:]
  assert result.stderr.startswith('error: --lang xx: the Moses tokenization of --tok_ref has no rules for it')
  assert ' de, ' in result.stderr and ' en, ' in result.stderr
  for lang in ('en', 'ja'):  # one with nonbreaking prefixes, one the tokenizer splits as CJK
    result = in_process.run(evaluate_command, [f'--hyp={good}', f'--ref={good}', f'--tok_ref={good}', f'--lang={lang}'])
    assert result.returncode == 0 and f'moses-tokenized ({lang})' in result.stdout, result.stderr[-2000:]


def test_compare_rows_take_sacrebleus_length_ratio_and_an_empty_checkpoint_list_is_refused(tmp_path):
  """Wrong rules caught: the length ratio was sys_len / ref_len, so references of blank lines ended compare with a
  ZeroDivisionError traceback after the whole decode; --checkpoints= printed an empty table and exited 0. The first
  pair's translations are short: the brevity penalty (0.846) is not the length ratio (0.857)."""
  from flaxformer_nmt.evaluation import compare as compare_lib  # pylint: disable=g-import-not-at-top
  for hypotheses, references in ((['ein hund läuft .', 'zwei katzen'], ['ein hund rennt .', 'zwei katzen schlafen']),
                                 (['ein hund'], [''])):
    bleu = sacrebleu.corpus_bleu(hypotheses, [references])
    cells = [c.strip() for c in compare_lib.table_row('latest', 'x', 1.0, bleu, None, 2.0).strip('|').split('|')]
    assert cells[5] == re.search(r'ratio = ([0-9.]+)', bleu.format()).group(1)  # sacreBLEU's own
    assert cells[6] == re.search(r'BP = ([0-9.]+)', bleu.format()).group(1)  # not the ratio again
  result = in_process.run(compare_command, [f'--workdir={tmp_path}', '--checkpoints='])
  assert result.returncode != 0 and '--checkpoints is empty' in result.stderr, result.stderr[-2000:]


def test_compare_scores_the_configs_split_against_the_tokenized_references_of_its_target_language(tmp_path):
  # Catches the split or the tokenized references read for the source language (here a file that exists too), the
  # config's eval_split not the default, and a split without tokenized references given another split's.
  import ml_collections  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.evaluation import compare as compare_lib  # pylint: disable=g-import-not-at-top
  data, tok = tmp_path / 'data', tmp_path / 'tok'
  data.mkdir()
  tok.mkdir()
  for split in ('valid', 'dev'):
    for lang in ('en', 'de'):
      (data / f'{split}.{lang}').write_text(f'{split} {lang} one\n{split} {lang} two\n')
  for lang in ('en', 'de'):
    (tok / f'dev.{lang}').write_text(f'dev tok {lang} one\ndev tok {lang} two\n')
  config = ml_collections.ConfigDict({'data_dir': str(data), 'eval_split': 'dev', 'source_lang': 'en',
                                      'target_lang': 'de', 'eval_bleu_tok_ref_dir': str(tok)})
  assert compare_lib.sentences(config) == (f'dev ({data})', ['dev en one', 'dev en two'],
                                           ['dev de one', 'dev de two'], ['dev tok de one', 'dev tok de two'])
  assert compare_lib.sentences(config, 'valid') == (f'valid ({data})', ['valid en one', 'valid en two'],
                                                    ['valid de one', 'valid de two'], None)


def test_compare_names_each_files_line_count_where_they_differ(tmp_path):
  # Catches an error that says the counts differ without them: the user then counts three files by hand.
  from flaxformer_nmt.evaluation import compare as compare_lib  # pylint: disable=g-import-not-at-top
  for name, lines in (('src', 3), ('ref', 2), ('tok', 3)):
    (tmp_path / name).write_text('a\n' * lines)
  with pytest.raises(ValueError, match=r'different numbers of lines \(3, 2, 3\)'):
    compare_lib.sentences(None, input_path=str(tmp_path / 'src'), ref_path=str(tmp_path / 'ref'),
                          tok_ref_path=str(tmp_path / 'tok'))


def test_compare_names_the_flag_or_split_of_a_file_it_cannot_read(tmp_path):
  # Catches an error naming a path alone (which of the three files?) or the wrong flag for it.
  import ml_collections  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.evaluation import compare as compare_lib  # pylint: disable=g-import-not-at-top
  (tmp_path / 'src').write_text('a\n')
  (tmp_path / 'ref').write_bytes(b'a\n\xff\n')
  with pytest.raises(ValueError, match=f'^--ref {tmp_path / "ref"}:2: invalid UTF-8'):
    compare_lib.sentences(None, input_path=str(tmp_path / 'src'), ref_path=str(tmp_path / 'ref'))
  with pytest.raises(ValueError, match=f'^--input {tmp_path}: '):
    compare_lib.sentences(None, input_path=str(tmp_path), ref_path=str(tmp_path / 'src'))
  with pytest.raises(ValueError, match=f'^--tok_ref {tmp_path / "nope"}: file not found'):
    compare_lib.sentences(None, input_path=str(tmp_path / 'src'), ref_path=str(tmp_path / 'src'),
                          tok_ref_path=str(tmp_path / 'nope'))
  config = ml_collections.ConfigDict({'data_dir': str(tmp_path), 'eval_split': 'dev', 'source_lang': 'en',
                                      'target_lang': 'de'})
  with pytest.raises(ValueError, match=f'^--split test: {tmp_path / "test.en"}: file not found'):
    compare_lib.sentences(config, 'test')


def fake_params(value):
  return {'w': np.full((2, 3), value, np.float32), 'b': np.arange(3, dtype=np.float32) + value}


def test_validation_bleu_falls_on_its_interval_and_at_a_run_s_end_off_it(toy_corpus, tmp_path, monkeypatch):
  """BLEU every 3 steps of a 7-step run scores steps 3, 6 and 7, the run's end: the parameters it leaves (and a
  best checkpoint by BLEU) would otherwise never be scored. The decode is replaced by a record of the steps."""
  from flaxformer_nmt.training import loop as train  # pylint: disable=g-import-not-at-top
  from flaxformer_nmt.training import validation  # pylint: disable=g-import-not-at-top
  scored = []
  monkeypatch.setattr(validation.ValidationBleu, 'evaluate',
                      lambda self, step, params: scored.append(step) or {'eval/bleu': float(step)})
  config = small_config(toy_corpus)
  config.num_train_steps, config.eval_bleu_every_steps, config.length_buckets = 7, 3, (32,)
  config.eval_every_steps = config.checkpoint_every_steps = config.log_every_steps = 100
  train.train_and_evaluate(config, tmp_path / 'run')
  assert scored == [3, 6, 7]


def test_best_is_replaced_only_by_a_better_value_and_survives_a_restart(tmp_path):
  tracker = best_checkpoint.BestCheckpoint(tmp_path, 'bleu')
  assert tracker.update(100, fake_params(1.0), {'eval/bleu': 20.0, 'eval/bleu_signature': 'sig'})
  assert not tracker.update(200, fake_params(2.0), {'eval/bleu': 19.5})  # worse
  assert not tracker.update(250, fake_params(2.5), {'eval/bleu': 20.0})  # equal: the earlier stays
  assert not tracker.update(260, fake_params(2.6), {'eval/loss': 0.1})  # no BLEU at this step
  params, info = best_checkpoint.load_best(tmp_path)
  assert info['step'] == 100 and info['value'] == 20.0
  np.testing.assert_array_equal(params['w'], fake_params(1.0)['w'])
  # A restarted run reads the best so far: a worse evaluation after the restart does not replace it.
  tracker = best_checkpoint.BestCheckpoint(tmp_path, 'bleu')
  assert tracker.best_value == 20.0 and tracker.best_step == 100
  assert not tracker.update(300, fake_params(3.0), {'eval/bleu': 15.0})
  assert tracker.update(400, fake_params(4.0), {'eval/bleu': 21.0})
  params, info = best_checkpoint.load_best(tmp_path)
  assert info['step'] == 400
  np.testing.assert_array_equal(params['b'], fake_params(4.0)['b'])
  assert sorted(p.name for p in (tmp_path / 'best').iterdir()) == ['best.json', 'params_400']
  # A fine-tuning run started from this workdir's best reads the same parameters.
  (tmp_path / 'config.json').write_text('{}')
  directory, subtree, _, description = warm_start.resolve(tmp_path, 'best')
  assert description.startswith('best (step 400)') and subtree is None
  np.testing.assert_array_equal(checkpoints_lib.read_params(directory)['w'], fake_params(4.0)['w'])


def test_a_best_json_write_cut_short_leaves_the_previous_best_whole(tmp_path, monkeypatch):
  """best.json was written in place: a process killed (or a disk filled) mid-write left a truncated file that
  stopped every later resume (BestCheckpoint reads it) and decode --checkpoint best."""
  import errno  # pylint: disable=g-import-not-at-top
  tracker = best_checkpoint.BestCheckpoint(tmp_path, 'bleu')
  assert tracker.update(100, fake_params(1.0), {'eval/bleu': 20.0})
  before = (tmp_path / 'best' / 'best.json').read_text()
  path_type = type(best_checkpoint.directory(tmp_path))
  write_text = path_type.write_text

  def cut_short(path, text, *args, **kwargs):  # the parameters are saved whole; best.json's text is cut
    if 'best.json' not in path.name:
      return write_text(path, text, *args, **kwargs)
    write_text(path, text[:20], *args, **kwargs)
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(path_type, 'write_text', cut_short)
  with pytest.raises(OSError, match='No space left'):
    tracker.update(200, fake_params(2.0), {'eval/bleu': 21.0})
  monkeypatch.undo()
  assert (tmp_path / 'best' / 'best.json').read_text() == before
  assert best_checkpoint.BestCheckpoint(tmp_path, 'bleu').best_step == 100
  params, info = best_checkpoint.load_best(tmp_path)
  assert info['step'] == 100
  np.testing.assert_array_equal(params['w'], fake_params(1.0)['w'])


def test_best_json_is_strict_json_when_another_metric_is_not_finite(tmp_path):
  # json.dumps writes NaN and Infinity, which Python reads back but JSON readers (jq, JavaScript) refuse.
  import json  # pylint: disable=g-import-not-at-top
  tracker = best_checkpoint.BestCheckpoint(tmp_path, 'bleu')
  assert tracker.update(100, fake_params(1.0), {'eval/bleu': 20.0, 'eval/loss': float('nan'),
                                                'eval/nll': float('inf'), 'eval/tok_bleu': 19.0})
  text = (tmp_path / 'best' / 'best.json').read_text()
  info = json.loads(text, parse_constant=lambda name: pytest.fail(f'best.json holds {name}'))
  assert info['value'] == 20.0 and info['metrics'] == {'eval/bleu': 20.0, 'eval/tok_bleu': 19.0}


def test_loss_is_minimized():
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    tracker = best_checkpoint.BestCheckpoint(workdir, 'loss')
    # A first evaluation that diverged is no best: every comparison with NaN is false, it would stay best.
    assert not tracker.update(0, fake_params(0.0), {'eval/loss': float('nan')})
    assert best_checkpoint.read_info(workdir) is None
    assert tracker.update(1, fake_params(1.0), {'eval/loss': 3.0})
    assert not tracker.update(2, fake_params(2.0), {'eval/loss': 3.5})
    assert tracker.update(3, fake_params(3.0), {'eval/loss': 2.5})
    assert not tracker.update(4, fake_params(4.0), {'eval/loss': float('nan')})
    assert best_checkpoint.read_info(workdir)['step'] == 3


def test_bad_best_and_bleu_fields_are_named(toy_corpus, tmp_path):
  config = small_config(toy_corpus)
  config.best_checkpoint_metric = 'bleu'
  with pytest.raises(ConfigError, match='eval_bleu_every_steps > 0'):
    config_lib.validate(config)
  config.eval_bleu_every_steps = 10
  config.best_checkpoint_metric = 'tok_bleu'
  with pytest.raises(ConfigError, match='tokenized validation reference'):
    config_lib.validate(config)
  config.best_checkpoint_metric = 'accuracy'
  with pytest.raises(ConfigError, match="best_checkpoint_metric='accuracy'"):
    config_lib.validate(config)
  with pytest.raises(FileNotFoundError, match='best_checkpoint_metric'):
    decode.load_params(tmp_path, 'best')


@pytest.mark.slow  # 41-61 s of the 2-core CI machine (a 4-device subprocess); -m slow runs it
def test_validation_bleu_decodes_sharded_parameters_like_host_ones():
  """Replicated over 4 devices or FSDP-sharded over 4, the in-training decode gives the translations of the
  same parameters on one device (which tests/test_quality.py's end-to-end test ties to decode.Translator)."""
  import os  # pylint: disable=g-import-not-at-top
  here = os.path.dirname(os.path.abspath(__file__))
  result = subprocess.run([sys.executable, os.path.join(here, 'sharded_bleu.py')], env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert len(report['1x1']) == 20 and len(set(report['1x1'])) > 1  # random parameters, distinct outputs
  for layout in ('4x1', '1x4'):
    assert report[layout] == report['1x1'], layout


def test_each_best_metric_follows_its_own_number_in_its_direction(tmp_path):
  """The evaluations disagree between BLEU and tokenized BLEU, and between loss and NLL: each tracker keeps the
  step its own metric prefers. Catches 'tok_bleu' tracking sacreBLEU and 'nll' tracking the label-smoothed loss."""
  evaluations = {100: {'eval/bleu': 20.0, 'eval/tok_bleu': 25.0, 'eval/loss': 2.0, 'eval/nll': 1.5},
                 200: {'eval/bleu': 22.0, 'eval/tok_bleu': 24.0, 'eval/loss': 2.1, 'eval/nll': 1.4}}
  best = {}
  for metric in ('bleu', 'tok_bleu', 'loss', 'nll'):
    tracker = best_checkpoint.BestCheckpoint(tmp_path / metric, metric)
    for step, metrics in evaluations.items():
      tracker.update(step, fake_params(float(step)), metrics)
    best[metric] = best_checkpoint.read_info(tmp_path / metric)['step']
  assert best == {'bleu': 200, 'tok_bleu': 100, 'loss': 100, 'nll': 200}


def test_a_best_kept_by_another_metric_is_not_compared_with_this_one(tmp_path):
  """A run resumed with another config.best_checkpoint_metric (loss, then BLEU) must not compare BLEU against the
  best loss (a BLEU of 1.5 is not better than a loss of 2.0): its first evaluation becomes the best."""
  assert best_checkpoint.BestCheckpoint(tmp_path, 'loss').update(100, fake_params(1.0), {'eval/loss': 2.0})
  tracker = best_checkpoint.BestCheckpoint(tmp_path, 'bleu')
  assert tracker.best_value is None
  assert tracker.update(200, fake_params(2.0), {'eval/bleu': 1.5, 'eval/loss': 2.5})
  assert best_checkpoint.read_info(tmp_path) | {'metrics': None} == {
      'metric': 'bleu', 'step': 200, 'value': 1.5, 'params': 'params_200', 'metrics': None}
