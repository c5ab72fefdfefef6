"""What the live view says of the producers: how many run, and auto's ceiling named as one. `producers 1/128` on a
2-core machine read as a count out of 128 expected (issue 53, item 16)."""

from stoker.observe.progress import Snapshot, panel


def _snapshot(producers: int, ceiling: int) -> Snapshot:
    return Snapshot(epoch=0, epochs=2, epoch_step=3, steps_per_epoch=10, step=3, total_steps=20, samples_per_s=50.0,
                    loss=1.0, val_accuracy=None, consumers=((0.9, 0.1, 0.0),), queue_fill=0.5, producers=producers,
                    producer_budget=ceiling, producer_utilization=0.4, verdict="compute-bound")


def _text(renderable) -> str:
    import io

    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_panel_and_the_log_line_name_auto_s_ceiling_as_a_ceiling():
    snapshot = _snapshot(2, 128)
    for shown in (_text(panel(snapshot)), snapshot.line()):
        assert "producers 2 (up to 128) busy 40%" in shown, shown
        assert "2/128" not in shown
