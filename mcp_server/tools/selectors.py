"""The job selectors the tools that take a pid also take (resolved by ServerState.job_pid)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

RankArg = Annotated[int | None, Field(description="Only this rank's process (a distributed job), instead of pid.")]
ContainerArg = Annotated[
    str | None, Field(description="Only this container's job: a container id (12+ hex) or a pod name.")
]
