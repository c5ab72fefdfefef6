"""Fine-tuning pays: a model pretrained on 6 of the built-in classes and trained on the other 4 with `--init` (a new
head) reaches a validation accuracy in fewer epochs than the same run from scratch. The test-sized form of
`stoker bench finetune` (one seed, 2 epochs); its full figures, 3 seeds over 6 epochs, are in docs/benchmarks.md."""

from __future__ import annotations

from stoker.bench.finetune import epochs_to, measure

TARGET = 0.45  # seed 0 at these sizes: fine-tuned 39% then 53%, scratch 17.5% then 26.7%


def test_fine_tuning_with_init_reaches_the_accuracy_in_fewer_epochs_than_scratch(tmp_path):
    figures = measure(tmp_path, pretrain_per_class=100, finetune_per_class=30, val_per_class=30, pretrain_epochs=4,
                      epochs=2, target=TARGET, seeds=1, devices="cpu:1")
    run = figures["runs"][0]
    finetuned, scratch = epochs_to(run["finetuned"], TARGET, 2), epochs_to(run["scratch"], TARGET, 2)
    assert finetuned < scratch, run
    assert all(f > s for f, s in zip(run["finetuned"], run["scratch"], strict=True)), run  # ahead at every epoch
