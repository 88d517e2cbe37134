"""The data service: a dispatcher and data workers run the input pipeline on other hosts; trainers consume.

    conveyor data serve --port 5050 --secret-file job.secret                  # the dispatcher
    conveyor data worker --dispatcher 10.0.0.5:5050 --port 6000 --pipeline myjob.input:train --secret-file job.secret
    ds = train().distribute(Service("10.0.0.5:5050", secret), processing_mode="distributed_epoch")
    ds = train().distribute(from_env(), processing_mode="distributed_epoch")   # under `conveyor run --data-workers K`

The roles: `dispatcher.Dispatcher`, `worker.DataWorker`; the trainer's side: `client.ServiceNode` (what
`Dataset.distribute` builds). Design and limits: docs/data-service.md.
"""

from conveyor.data.service.protocol import MODES, DataServiceError, PipelineMismatchError, Service, from_env

__all__ = ["MODES", "DataServiceError", "PipelineMismatchError", "Service", "from_env"]
