"""The host-memory EMA (`raypar.host_ema.HostEma`) on its own: folds, ordered snapshots."""
import torch

from raypar.host_ema import HostEma


def test_folds_equal_the_formula_and_a_snapshot_holds_the_average_when_asked():
    torch.manual_seed(0)
    masters = [torch.randn(64, 32), torch.randn(7)]
    ema = HostEma(masters)
    want = [m.clone() for m in masters]
    snapshots = []
    for decay in (0.9, 0.5, 0.99):
        with torch.no_grad():
            for m in masters:
                m.add_(torch.randn_like(m))  # an optimizer step
        ema.update(decay)
        want = [decay * w + (1 - decay) * m for w, m in zip(want, masters)]
        saved = ema.snapshot().result()
        snapshots.append([t.clone() for t in saved])
        for got, w in zip(snapshots[-1], want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    ema.settle()
    for got, w in zip(ema.ema, want):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)
    assert not torch.equal(snapshots[0][0], snapshots[-1][0])


def test_a_snapshot_asked_before_the_next_update_misses_it():
    masters = [torch.zeros(1000)]
    ema = HostEma(masters)
    masters[0].fill_(1.0)
    ema.update(0.5)
    pending = ema.snapshot()  # ordered after the first fold, before the second
    masters[0].fill_(3.0)
    ema.update(0.5)
    assert torch.all(pending.result()[0] == 0.5)
    ema.settle()
    assert torch.all(ema.ema[0] == 1.75)
