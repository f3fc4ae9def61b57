"""The forwarding routes solve no dependencies: one declared on them would silently not run, so it is
refused when the route is made."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from manager.deps import ForwardRoute, require_inference_access


async def forward(request: Request) -> Response:
    return Response()


def test_a_dependency_the_endpoint_does_not_do_itself_is_refused():
    def rate_limit() -> None: ...

    router = APIRouter(route_class=ForwardRoute, dependencies=[Depends(rate_limit)])
    with pytest.raises(TypeError, match="rate_limit"):
        router.add_api_route("/v1/x", forward, methods=["POST"])


def test_the_access_check_it_does_itself_is_allowed():
    router = APIRouter(route_class=ForwardRoute, dependencies=[Depends(require_inference_access)])
    router.add_api_route("/v1/x", forward, methods=["POST"])
    assert [route.path for route in router.routes] == ["/v1/x"]
