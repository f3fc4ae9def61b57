"""Database tables and API shapes, one module per thing."""

from manager.schemas.browser_session import BrowserSession
from manager.schemas.download import Download
from manager.schemas.event import Event
from manager.schemas.inference_key import InferenceAccess, InferenceKey
from manager.schemas.lora_adapter import LoraAdapter
from manager.schemas.model_config import ModelConfig
from manager.schemas.offload_profile import OffloadProfile
from manager.schemas.routing_name import RoutingName
from manager.schemas.token import ApiToken
from manager.schemas.usage import UsageMinute
from manager.schemas.worker import Worker

__all__ = [
    "ApiToken",
    "BrowserSession",
    "Download",
    "Event",
    "InferenceAccess",
    "InferenceKey",
    "LoraAdapter",
    "ModelConfig",
    "OffloadProfile",
    "RoutingName",
    "UsageMinute",
    "Worker",
]
