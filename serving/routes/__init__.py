"""HTTP routers. Each module exposes `router` (a fastapi.APIRouter) and may expose `lifespan`
(an async context manager factory taking the app, run inside the app's own).

create_app() adds the routes of every module listed in ROUTER_MODULES, in order. A later feature
(chat completions, audio speech, images, jobs with webhooks, the realtime voice websocket)
adds its module here with one line.
"""

ROUTER_MODULES: list[str] = [
    "omnistage.serving.routes.system",  # /health, /ready, /metrics
    "omnistage.serving.routes.models",  # /v1/models
    "omnistage.serving.routes.pipelines",  # /v1/pipelines/{name}/run (generic JSON)
    "omnistage.serving.routes.chat",  # /v1/chat/completions (pipelines that serve chat)
    "omnistage.serving.routes.completions",  # /v1/completions
    "omnistage.serving.routes.images",  # /v1/images/generations
    "omnistage.serving.routes.image_edits",  # /v1/images/edits
    "omnistage.serving.routes.image_files",  # /v1/images/files/{name} (response_format url)
    "omnistage.serving.routes.speech",  # /v1/audio/speech
    "omnistage.serving.routes.jobs",  # /v1/jobs (async jobs, events, outputs; docs/jobs.md)
    "omnistage.serving.routes.videos",  # /v1/videos (OpenAI's video API over jobs)
    "omnistage.serving.routes.realtime",  # WS /v1/realtime (voice sessions; docs/realtime.md)
    "omnistage.serving.routes.demo",  # GET / the browser demo, /static/* its files (docs/demo.md)
]
