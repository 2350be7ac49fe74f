import pytest

from rlbus.tracking.tensorboard_sink import TensorBoardSink
from tests.unit.tracking.conftest import PARAMS, ROWS, write
from tests.unit.tracking.readers import (
    tensorboard_histogram,
    tensorboard_hparams,
    tensorboard_scalars,
)

pytest.importorskip("tensorboard")


def test_scalars_histogram_and_hyperparameters_read_back(where):
    sink = TensorBoardSink(where)
    write(sink)
    assert sink.folder == where.folder / "tensorboard" / "r1"
    scalars = tensorboard_scalars(sink.folder)
    for key in ROWS[0]:
        assert scalars[key] == pytest.approx({1: ROWS[0][key], 2: ROWS[1][key]})
    (hist,) = tensorboard_histogram(sink.folder, "staleness").values()
    assert (hist.min, hist.max, hist.num, hist.sum) == (0, 2, 4, 4)
    assert [c for c in hist.bucket if c] == [1, 2, 1]  # one bin per version
    assert tensorboard_hparams(sink.folder) == PARAMS
