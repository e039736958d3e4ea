"""Planning: decide what applying a patchset does (kernel choice, the fused head switch) and show it (report).
Pure decisions: nothing here changes a model."""
