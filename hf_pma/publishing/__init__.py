"""Records, the model card, the training plot and the Hub push of a merged model."""
