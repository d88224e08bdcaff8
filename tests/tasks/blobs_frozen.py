"""The blobs task with the job's own SGD and a schedule of 0 throughout: a job that follows the schedule takes no
step, so it ends with the model it began with."""

from blobs import task

import dynabatch as db

frozen = db.Task(
    model=task.model,
    train_data=task.train_data,
    eval_data=task.eval_data,
    loss=task.loss,
    metrics=task.metrics,
    schedule=db.schedule.step([0.0], gamma=0.0),
)
