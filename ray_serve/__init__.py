"""Ray Serve backend: the same pipeline YAML as a Serve application (see docs/scale-out.md).

options.py   a stage pool -> Serve deployment options (replicas, actor resources, autoscaling)
replica.py   StageReplica: one deployment replica running the embedded worker's engine loop
router.py    PinnedRouter: follow-up calls of a request reach the replica that holds it
driver.py    RayDriver: the embedded Router's graph routing, with Serve calls for pipe messages
calls.py     the driver's side of those calls: edge permits, a link per replica, a call per stage
scaling.py   the autoscaling policy: replicas sized by the requests their engines hold
pipeline.py  RayPipeline: the Pipeline API over a RayDriver (what the FastAPI routes call)
app.py       build_app: stage deployments + the FastAPI ingress, one Serve application
config.py    `omnistage ray-config`: the Serve config file (serve run / serve deploy / KubeRay)
cli.py       `omnistage serve --backend ray`: connect to (or start) Ray and run the app
"""
