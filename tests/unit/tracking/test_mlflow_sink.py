import pytest

from rlbus.tracking.mlflow_sink import MlflowSink
from tests.unit.tracking.conftest import PARAMS, ROWS, write
from tests.unit.tracking.readers import mlflow_history, mlflow_run

pytest.importorskip("mlflow")


def test_file_store_reads_back(where):
    write(MlflowSink(where))
    uri = where.mlflow_uri
    for key in ROWS[0]:
        assert mlflow_history(uri, "proj", key) == {1: ROWS[0][key], 2: ROWS[1][key]}
    assert mlflow_history(uri, "proj", "staleness/mean") == {2: 1.0}
    assert mlflow_history(uri, "proj", "staleness/max") == {2: 2.0}
    _, run = mlflow_run(uri, "proj")
    assert run.info.run_name == "r1"
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in PARAMS.items()}


def test_more_params_than_one_batch_takes(where):
    sink = MlflowSink(where)
    sink.hyperparameters({f"p{i}": i for i in range(250)})
    sink.close()
    _, run = mlflow_run(where.mlflow_uri, "proj")
    assert len(run.data.params) == 250
