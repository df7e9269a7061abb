"""Scale-out on Ray Serve: one OpenAI ingress over N engine replicas, each request routed to the replica that
holds its prefix (unless that one is overloaded). The core is untouched: a replica is an AsyncLLM, and the
ingress is the single server's app over `RemoteEngine`, an object with AsyncLLM's face.

    prefix_index.py     PrefixIndex: block-hash chains -> the replicas they were routed to (LRU, approximate)
    routing_policy.py   RouterConfig, RoutingPolicy: prefix / least-loaded / round-robin over loads and matches
    request_router.py   PagedServeRequestRouter: the policy as a Ray Serve RequestRouter (in-flight counts)
    engine_replica.py   EngineReplica: the deployment that runs one AsyncLLM and streams its outputs
    replica_board.py    ReplicaBoard: the deployment the replicas report their metrics to
    replica_error.py    ReplicaError: engine refusals as data through Ray, raised again as the same exception
    remote_engine.py    RemoteEngine: the ingress's engine (routing hashes, retries, errors back as exceptions)
    metrics_merge.py    the ingress's /metrics: its own families plus the replicas', each with a replica label
    ingress.py          OpenAIIngress: the server app as the ingress deployment; IngressEdge (drain, X-Request-Id)
    config.py           RayConfig: the --ray flags and the engine deployment's scaling options
    serve_args.py       `pagedserve serve` args from Serve's builder arguments (flag names and values)
    app.py              build_app: the Serve application (board, engine replicas with the router, ingress)
    launcher.py         serve_on_ray: `pagedserve serve --ray` (cluster, proxy, app, draining shutdown)
"""
