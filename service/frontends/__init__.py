"""Front-ends as Ray actors: `[frontends] count` of them placed across the Ray cluster,
each serving the gRPC port of its node, all sharing the one scheduler actor."""
